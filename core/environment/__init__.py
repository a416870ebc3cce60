"""What the process environment says, read in one place: every `LORAPLEX_*` variable (`variables.py`) and the
kernel backend each family runs on (`backends.py`: auto|torch|triton, Triton's availability and interpreter).

Part of core: gateway and core use it; grammar/ and adapters/ never import core, so the engine resolves what
they need here (the LoRA and bitmask paths, the grammar compile limits) and passes it down. No other module
reads `os.environ` (tests/test_core/environment/test_env_variables.py scans for that). Imports neither torch
nor triton at import time, so the CLI parses its flags without them. docs/environment.md documents every variable.
"""
