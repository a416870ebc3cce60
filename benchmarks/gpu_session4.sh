#!/usr/bin/env bash
# The GPU session for issue 13 (start-up warm-up, fused BGMV LoRA decode, async scheduling, serving with adapters).
# Each stage fits one device call (<= 10 min); results land in $OUT and benchmarks/results/.
#   bash benchmarks/gpu_session4.sh tests roofline offline     # call 1
#   bash benchmarks/gpu_session4.sh lora                       # call 2
#   bash benchmarks/gpu_session4.sh serving summary plots      # call 3 (needs the JSONs of calls 1-2 in $OUT copied back)
#   bash benchmarks/gpu_session4.sh spec                       # issue 26 item 7: a verification step (eager) vs a decode step
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton}
TAG=${TAG:-h100}
nvidia-smi -L
mkdir -p "$OUT"
M="--model llama3-8b-dummy --device cuda --dtype bfloat16"
for what in "${@:-tests}"; do
  case $what in
    tests) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_decode_graphs.py tests/test_triton_attention.py \
             tests/adapters tests/test_kernel_warmup.py > "$OUT/tests.log" 2>&1; tail -5 "$OUT/tests.log" ;;
    roofline) for a in on off; do
                python3 benchmarks/decode_roofline.py $M --async-scheduling $a --batch-sizes 1,8,64,128,256 \
                  --name decode_roofline_${TAG}_async_$a 2>&1 | grep -v "^{" | tail -12
              done
              cp benchmarks/results/decode_roofline_${TAG}_async_on.json benchmarks/results/decode_roofline_${TAG}.json
              cp benchmarks/results/decode_roofline_${TAG}_async_*.* "$OUT"/ ;;
    offline) python3 benchmarks/offline_throughput.py $M --num-requests 64 --hf-batch-size 64 --hf-repeats 1 \
               --async-scheduling on,off --name offline_throughput_${TAG} 2>&1 | tail -8
             cp benchmarks/results/offline_throughput_${TAG}.* "$OUT"/ ;;
    lora) python3 benchmarks/lora_overhead.py $M --num-requests 64 --prompt-len 128 --max-tokens 64 --targets all \
            --name lora_overhead_${TAG}_all 2>&1 | tail -4
          cp benchmarks/results/lora_overhead_${TAG}_all.* "$OUT"/ ;;
    serving) timeout 580 python3 benchmarks/serving.py $M --num-requests 256 --name serving_${TAG} 2>&1 | grep -v "^{" | tail -12
             cp benchmarks/results/serving_${TAG}.* "$OUT"/ ;;
    spec) python3 benchmarks/spec_verify_cost.py $M --batch-sizes 1,8,32,64 --context 1024 --k 4 \
            --name spec_verify_cost_${TAG} 2>&1 | tail -8
          cp benchmarks/results/spec_verify_cost_${TAG}.* "$OUT"/ ;;
    summary) python3 benchmarks/gpu_summary.py --tag $TAG --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
             cp benchmarks/results/gpu_serving.* "$OUT"/ ;;
    plots) python3 benchmarks/plot_results.py && cp benchmarks/results/*.png "$OUT"/ ;;
  esac
done
ls "$OUT"
