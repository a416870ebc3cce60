#!/usr/bin/env bash
# One entry point for the two set-up commands of the README:
#   bash scripts/dev.sh serve [loraplex serve flags...]   -> starts the server (embedded demo model by default)
#   bash scripts/dev.sh test  [pytest args...]            -> runs the whole test suite
# Creates .venv at the repo root on first use and installs what is needed: CPU torch==2.13.0 when no
# NVIDIA GPU is present, the normal CUDA build otherwise. Later runs reuse the venv (seconds).
set -euo pipefail
USER_DIR="$PWD"   # relative paths in serve flags (--tenant-keys FILE, --lora-modules ...) resolve from here
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY=${PYTHON:-python3}
VENV="$ROOT/.venv"
STAMP="$VENV/.loraplex-installed"
want="$(cat pyproject.toml scripts/dev.sh | sha256sum | cut -c1-16)"

say() { echo "dev.sh: $*" >&2; }   # set-up progress on stderr, one line per phase

if [ ! -x "$VENV/bin/python" ]; then
  say "creating the virtual environment $VENV (first run only)"
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  started=$SECONDS
  say "installing dependencies into .venv (first run, or pyproject.toml changed; a few minutes)"
  say "upgrading pip"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    say "installing torch==2.13.0 (CUDA build: an NVIDIA GPU is present; about 2.5 GB)"
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  elif "$VENV/bin/python" -c "import socket; socket.getaddrinfo('download.pytorch.org', 443)" 2>/dev/null; then
    say "installing torch==2.13.0 (CPU wheel from download.pytorch.org: no NVIDIA GPU found)"
    "$VENV/bin/python" -m pip install -q "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu
  else  # no route to the CPU wheel index: a local wheel cache (find-links) or PyPI's build
    say "installing torch==2.13.0 (from PyPI or the local wheel cache: download.pytorch.org unreachable)"
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  fi
  say "installing loraplex and its test dependencies (pip install -e '.[test]')"
  "$VENV/bin/python" -m pip install -q -e ".[test]"
  echo "$want" > "$STAMP"
  say "set-up done in $((SECONDS - started)) s; later runs reuse .venv"
fi

cmd=${1:-test}
shift || true
case "$cmd" in
  serve) cd "$USER_DIR" && exec "$VENV/bin/loraplex" serve "$@" ;;
  test)  # the whole suite runs on 2 workers (pytest-xdist); a run with arguments (one file, -k, -x) runs as given.
         # --dist loadfile: a file's tests run on one worker, so a module-scoped server or engine starts once, and
         # no worker is left holding a long queue of slow tests while the other idles (`load` hands out chunks)
         if [ $# -eq 0 ]; then set -- -n "${LORAPLEX_TEST_WORKERS:-2}" --dist loadfile; fi
         exec "$VENV/bin/python" -m pytest "$@" ;;
  *) echo "usage: bash scripts/dev.sh serve|test [args...]" >&2; exit 2 ;;
esac
