#!/usr/bin/env bash
# One device call: install carried wheels, check the Triton kernels, run the GPU benchmarks.
# Usage on the device machine: bash benchmarks/gpu_session.sh [kernels|lora|offline|all]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 LORAPLEX_ATTENTION_BACKEND=${LORAPLEX_ATTENTION_BACKEND:-torch}
nvidia-smi -L
what=${1:-all}
if [ "$what" = kernels ] || [ "$what" = all ]; then
  python3 benchmarks/gpu_kernels.py 2>&1 | tail -20
fi
if [ "$what" = lora ] || [ "$what" = all ]; then
  python3 benchmarks/lora_overhead.py --model llama3-8b-dummy --device cuda --dtype bfloat16 \
    --num-requests 64 --prompt-len 128 --max-tokens 64 2>&1 | tail -8
fi
if [ "$what" = offline ] || [ "$what" = all ]; then
  python3 benchmarks/offline_throughput.py --model llama3-8b-dummy --device cuda --dtype bfloat16 \
    --num-requests 64 --name offline_throughput_h100_llama3_8b 2>&1 | tail -8
fi
# at most 8 files come back from $OUT: only this session's results
mkdir -p "$OUT" && cp benchmarks/results/gpu_kernels.* benchmarks/results/lora_overhead_cuda.* \
  benchmarks/results/offline_throughput_h100_llama3_8b.* "$OUT"/ 2>/dev/null
ls "$OUT"
