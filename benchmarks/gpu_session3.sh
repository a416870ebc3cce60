#!/usr/bin/env bash
# One device call for issue 7: GPU tests of the graph path, decode roofline, offline throughput vs HF.
# Usage on the device machine: bash benchmarks/gpu_session3.sh [tests|roofline|offline|lora|serving|plots]...
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi -L
mkdir -p "$OUT"
M="--model llama3-8b-dummy --device cuda --dtype bfloat16"
for what in "${@:-all}"; do
  case $what in
    tests) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_decode_graphs.py tests/test_triton_attention.py \
             tests/adapters > "$OUT/tests.log" 2>&1; tail -5 "$OUT/tests.log" ;;
    roofline) python3 benchmarks/decode_roofline.py $M --name decode_roofline_h100 2>&1 | grep -v "^{" | tail -16
              cp benchmarks/results/decode_roofline_h100.* "$OUT"/ ;;
    offline) python3 benchmarks/offline_throughput.py $M --num-requests 64 --hf-batch-size 64 --hf-repeats 1 --async-scheduling on,off \
               --name offline_throughput_h100_llama3_8b 2>&1 | tail -8
             cp benchmarks/results/offline_throughput_h100_llama3_8b.* "$OUT"/ ;;
    lora) for t in all attn; do
            python3 benchmarks/lora_overhead.py $M --num-requests 64 --prompt-len 128 --max-tokens 64 --targets $t \
              --name lora_overhead_h100_$t 2>&1 | tail -4
            cp benchmarks/results/lora_overhead_h100_$t.* "$OUT"/
          done ;;
    serving) python3 benchmarks/serving.py $M --name serving_h100 2>&1 | grep -v "^{" | tail -10
             cp benchmarks/results/serving_h100.* "$OUT"/ ;;
    plots) python3 benchmarks/plot_results.py && cp benchmarks/results/*.png "$OUT"/ ;;
  esac
done
ls "$OUT"
