"""What the process environment says, read in one place: every `LORAPLEX_*` variable (`variables.py`) and the
kernel backend each family runs on (`backends.py`: auto|torch|triton, Triton's availability and interpreter).

A leaf below every other package (gateway -> core -> grammar / adapters -> environment): each of them may
use it, none of them reads `os.environ` itself (tests/test_environment/test_variables.py scans for that).
Imports neither torch nor triton at import time, so the CLI parses its flags without them.
docs/environment.md documents every variable.
"""
