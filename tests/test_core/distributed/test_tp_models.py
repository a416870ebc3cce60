"""Tensor parallelism on gloo (CPU, fp32) on more shapes: Qwen2 (tied embeddings, q/k/v biases, 1 KV head
replicated on both ranks, prefix caching off) at N=2 and Llama GQA at N=4 (2 KV heads on 4 ranks) equal HF
transformers greedy token for token. One engine at a time (each spawns N-1 workers)."""
from __future__ import annotations

from tp_cases import GREEDY, check_hf, tp_llm
from testlib import PROMPTS


def test_qwen2_tied_tp2_replicated_kv_head_no_prefix_cache() -> None:
    for llm in tp_llm("qwen2_tied", 2, enable_prefix_caching=False):   # 1 KV head on 2 ranks: replicated
        check_hf(llm, "qwen2_tied", PROMPTS[:5])
        again = llm.generate(PROMPTS[4:5], GREEDY)[0]
        assert again.num_cached_tokens == 0


def test_llama_tp4_matches_hf() -> None:
    for llm in tp_llm("llama_gqa", 4):                                 # 2 KV heads on 4 ranks: replicated
        check_hf(llm, "llama_gqa", PROMPTS[:2])
