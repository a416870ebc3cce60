#!/usr/bin/env bash
# The GPU benchmark run (benchmarks/gpu_run.py) on a lent GPU, one device call at a time:
#   bash benchmarks/gpu_run.sh [gpu_run.py args]   # installs .whl/*.whl (benchmarks/gpu_wheels.txt) into /tmp/site,
#                                                  # runs the next pending stages that fit 540 s, prints the table last
#   bash benchmarks/gpu_run.sh --dry-run           # the CPU: no wheels, tiny model, every stage (under 2 minutes)
#   bash benchmarks/gpu_run.sh --download-wheels   # here, with network: the wheels into .whl/ for Python 3.12
# After each call unpack $OUT/gpu_run.tar.gz (from the call's files) into the repository, so the next call resumes.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--download-wheels" ]; then
  mkdir -p .whl
  exclude=$(git rev-parse --git-path info/exclude) && mkdir -p "$(dirname "$exclude")"
  grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
  exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl -r benchmarks/gpu_wheels.txt
fi
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton}
if [[ " $* " != *" --dry-run "* ]]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    stamp=/tmp/site/.loraplex-wheels
    want=$(ls .whl/*.whl | sha256sum | cut -c1-16)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then      # a warm machine keeps /tmp/site: install once
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_run.sh: installing .whl/ failed" >&2; exit 1; }
      echo "$want" > "$stamp"
    fi
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_run.sh: no .whl/*.whl: using the packages already installed (see benchmarks/gpu_wheels.txt)" >&2
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
  command -v nvidia-smi >/dev/null && nvidia-smi -L
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
exec $PY benchmarks/gpu_run.py "$@"
