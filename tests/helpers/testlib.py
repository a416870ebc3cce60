"""Shared test helpers: tiny random models built offline, and HF transformers greedy references.

Imported as `from testlib import ...` (a `conftest` module name is ambiguous: pytest loads several)."""
from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CHAT_TEMPLATES = Path(__file__).resolve().parent / "chat_templates"   # chat templates of the gateway tests

import pytest
import torch

from tiny_models import LLAMA3_ROPE_SCALING, TinyModelSpec, tiny_model_dir

torch.set_num_threads(1)  # tiny models: one thread is faster, and CI shares 2 cores with the server subprocesses

SPECS: dict[str, TinyModelSpec] = {
    "llama_gqa": TinyModelSpec(arch="llama", num_heads=4, num_kv_heads=2, seed=1),
    "qwen2_tied": TinyModelSpec(arch="qwen2", num_heads=4, num_kv_heads=1, tie_word_embeddings=True, seed=2),
    "llama3_rope": TinyModelSpec(arch="llama", num_heads=4, num_kv_heads=4, rope_scaling=LLAMA3_ROPE_SCALING,
                                 rope_theta=500000.0, config_style="legacy", seed=3),
    "mistral": TinyModelSpec(arch="mistral", num_heads=8, num_kv_heads=2, hidden_size=64, seed=4),
    # llama_gqa's shapes with one layer: every layer launches the same kernel variants (the slot pool aligns every
    # layer's views as layer 0's: test_kernel_warmup.py::test_every_layer_launches_the_warmed_up_lora_variants),
    # so tests that only record launches (tests/test_core/startup/test_kernel_warmup.py) run half the interpreted kernels
    "llama_gqa_1layer": TinyModelSpec(arch="llama", num_heads=4, num_kv_heads=2, num_layers=1, seed=1),
}

PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n",
    "class Cache:\n    def __init__(self, size):\n        self.size = size\n",
    "x",
    "for i in range(10):\n    print(i * i)\n" * 4,
    "    return {key: value for key, value in sorted(items.items())}\n",
    "# Copyright 2001 Python Software Foundation\n" * 6,
    "while True:\n    line = stream.readline()\n    if not line:\n        break\n",
]


def model_dir(name: str) -> Path:
    return tiny_model_dir(SPECS[name])


@lru_cache(maxsize=8)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@lru_cache(maxsize=8)
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def encode(path: Path, text: str) -> list[int]:
    return _tokenizer(str(path)).encode(text)


@lru_cache(maxsize=4096)
def _hf_greedy(path: str, prompt_ids: tuple[int, ...], max_new_tokens: int, stop_at_eos: bool) -> tuple[int, ...]:
    model = _hf_model(path)
    ids = torch.tensor([prompt_ids])
    kwargs = {} if stop_at_eos else {"eos_token_id": None}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=0 if stop_at_eos else max_new_tokens, do_sample=False,
                             pad_token_id=0, **kwargs)
    return tuple(out[0, len(prompt_ids):].tolist())


def hf_greedy(path: Path, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
    """HF transformers `generate` greedy continuation (fp32, CPU), EOS included when it stops there."""
    return list(_hf_greedy(str(path), tuple(prompt_ids), max_new_tokens, stop_at_eos))


def run_staggered(engine, prompts: list[list[int]], params, seed: int = 0, check: bool = False,
                  abort_rate: float = 0.0, aborted: set[str] | None = None) -> dict[str, list[int]]:
    """Adds requests at random steps while the engine runs (and, with `abort_rate`, aborts live ones at
    random, recording their ids in `aborted`); returns token ids per request id."""
    import random

    rng = random.Random(seed)
    waiting = list(enumerate(prompts))
    outputs: dict[str, list[int]] = {}
    aborted = set() if aborted is None else aborted
    while waiting or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if waiting:
                i, ids = waiting.pop(0)
                engine.add_request(str(i), ids, params)
                outputs[str(i)] = []
        for delta in engine.step():
            assert delta.request_id not in aborted, "a delta after the abort"
            outputs[delta.request_id].extend(delta.new_token_ids)
        live = [rid for rid in outputs if rid not in aborted and rid in engine.scheduler.requests]
        if abort_rate and live and rng.random() < abort_rate:
            rid = rng.choice(live)
            engine.abort_request(rid)
            aborted.add(rid)
        if check:
            engine.check_integrity()
    return outputs
