"""`scripts/dev.sh` says on stderr what each set-up phase does (a first run installs for minutes), then starts
the server; a second run reuses the venv silently. Run on a copy of the script with a stand-in Python whose
venv records the pip calls (no network, nothing installed)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for python3: `-m venv DIR` makes a venv whose python logs its arguments and whose loraplex echoes
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin"
  printf '#!/usr/bin/env bash\\n[ "$1" = "-c" ] && exit 1\\necho "python $*" >> "%s"\\n' "$LOG" > "$3/bin/python"
  printf '#!/usr/bin/env bash\\necho "loraplex $*"\\n' > "$3/bin/loraplex"
  chmod +x "$3/bin/python" "$3/bin/loraplex"
fi
"""


def run(root: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(root / "scripts" / "dev.sh"), "serve", "--port", "9"], capture_output=True,
                          text=True, env=env, timeout=60, cwd=root)


def test_first_run_prints_each_phase_then_serves(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "dev.sh", root / "scripts" / "dev.sh")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "fakepython"
    fake.write_text(FAKE_PYTHON)
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\nexit 1\n")   # no GPU here
    for script in bin_dir.iterdir():
        script.chmod(0o755)
    log = tmp_path / "pip.log"
    env = dict(os.environ, PYTHON=str(fake), LOG=str(log), PATH=f"{bin_dir}:{os.environ['PATH']}")

    first = run(root, env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "loraplex serve --port 9"        # progress never goes to stdout
    phases = [line for line in first.stderr.splitlines() if line.startswith("dev.sh: ")]
    expected = ["creating the virtual environment", "installing dependencies", "upgrading pip",
                "installing torch==2.13.0", "installing loraplex", "set-up done"]
    assert len(phases) == len(expected) and all(want in got for want, got in zip(expected, phases)), phases
    assert "PyPI" in phases[3]                                        # no route to the CPU wheel index here
    pip_calls = log.read_text().splitlines()
    assert any("torch==2.13.0" in c for c in pip_calls) and any("-e .[test]" in c for c in pip_calls)

    second = run(root, env)
    assert second.returncode == 0 and second.stderr == "" and second.stdout.strip() == "loraplex serve --port 9"
