#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$OUT"
LORAPLEX_ATTENTION_BACKEND=torch python3 benchmarks/lora_overhead.py --model llama3-8b-dummy --device cuda \
  --dtype bfloat16 --num-requests 64 --prompt-len 128 --max-tokens 64 > "$OUT/lora_torchattn.log" 2>&1
python3 benchmarks/offline_throughput.py --model llama3-8b-dummy --device cuda --attention-backends torch,triton \
  --dtype bfloat16 --num-requests 64 --name offline_throughput_h100_llama3_8b 2>&1 | tail -7
LORAPLEX_ATTENTION_BACKEND=triton python3 benchmarks/profile_lora_step.py > "$OUT/profile_lora.txt" 2>&1
cp benchmarks/results/lora_overhead_cuda.json benchmarks/results/lora_overhead_cuda.md \
   benchmarks/results/offline_throughput_h100_llama3_8b.json \
   benchmarks/results/offline_throughput_h100_llama3_8b.md "$OUT"/
tail -5 "$OUT/lora_torchattn.log"; grep -A 18 "=== lora" "$OUT/profile_lora.txt" | cut -c1-160
