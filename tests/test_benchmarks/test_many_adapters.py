"""The pieces of benchmarks/many_adapters.py (its end-to-end dry run is a stage of benchmarks/gpu_run.py's dry
run, tests/test_benchmarks/test_gpu_run.py): the adapter builder writes valid PEFT adapters of the ranks and
targets it says, the Zipf sampler draws with P(i) ~ 1/(i+1)^s, and the cold-request estimate is an LRU replay."""
from __future__ import annotations

import json
import math
import random
import sys
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoConfig

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from many_adapters import (  # noqa: E402
    DEMO, MIXES, RANKS, adapter_names, build_adapters, failed_requests, failure_lines, lru_cold, zipf_choices,
)

from adapters.layers.dims import BaseModelDims  # noqa: E402
from adapters.peft.loader import load_peft_adapter  # noqa: E402


def test_builder_writes_valid_adapters_of_every_rank_and_mix(tmp_path: Path) -> None:
    built = build_adapters(tmp_path, DEMO, 16, "mix", torch.bfloat16)
    dims = BaseModelDims.from_hf_config(AutoConfig.from_pretrained(DEMO))
    assert built["num_adapters"] == 16 and built["disk_bytes"] > 0
    seen_a = set()
    for i, name in enumerate(adapter_names(16)):
        cfg = json.loads((tmp_path / name / "adapter_config.json").read_text())
        ad = load_peft_adapter(str(tmp_path / name), dims, max(RANKS))
        rank, mix = RANKS[i % len(RANKS)], MIXES["mix"][(i // len(RANKS)) % len(MIXES["mix"])]
        assert cfg["r"] == rank and tuple(cfg["target_modules"]) == mix
        assert {m for _, m in ad.modules} == set(mix)
        assert {layer for layer, _ in ad.modules} == set(range(dims.num_layers))
        assert all(mod.rank == rank and mod.lora_a.dtype == torch.bfloat16 for mod in ad.modules.values())
        a = ad.modules[(0, mix[0])].lora_a
        assert torch.isfinite(a.float()).all() and a.float().abs().sum() > 0
        seen_a.add(a.float().sum().item())
    assert len(seen_a) == 16                                  # every adapter's weights differ
    assert abs(built["disk_bytes"] - sum((tmp_path / n / "adapter_model.safetensors").stat().st_size
                                         for n in adapter_names(16))) == 0


def test_builder_writes_valid_adapters_for_a_deep_model(tmp_path: Path) -> None:
    """The GPU run (Llama-3-8B shape, 32 layers) failed every request to a0027: its layers 4-7 had lora_B
    (4096, 31..28) beside lora_A (32, 4096), B's columns cut short by a bank one layer shift too narrow. Only
    models of more than 4 layers show it (the demo model has 4): every adapter of a 64-adapter cycle of offsets,
    on an 8-layer model, must load."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "max_position_embeddings": 64}))
    dims = BaseModelDims.from_hf_config(AutoConfig.from_pretrained(model))
    build_adapters(tmp_path / "loras", str(model), 64, "qv", torch.bfloat16)
    for i, name in enumerate(adapter_names(64)):
        ad = load_peft_adapter(str(tmp_path / "loras" / name), dims, max(RANKS))
        assert len(ad.modules) == 2 * 8 and all(m.rank == RANKS[i % len(RANKS)] for m in ad.modules.values())


def test_failed_requests_are_grouped_by_adapter_and_error() -> None:
    bad = "HTTP 400: lora_B does not fit"
    results = [{"model": "a1", "error": None}, {"model": "a27", "error": bad}, {"model": "a3", "error": "in-band"},
               {"model": "a27", "error": bad}]
    failures = failed_requests(results)
    assert failures == [{"adapter": "a27", "error": bad, "num_requests": 2},
                        {"adapter": "a3", "error": "in-band", "num_requests": 1}]
    assert failure_lines([{"phase": "32 adapters", "failures": failures}]) == [
        f"32 adapters: 2 x a27: {bad}", "32 adapters: 1 x a3: in-band"]
    assert failed_requests([{"model": "a1", "error": None}]) == []


def test_zipf_draws_follow_one_over_rank() -> None:
    n, draws = 50, 40_000
    counts = Counter(zipf_choices(n, draws, 1.0, random.Random(3)))
    assert set(counts) <= set(range(n))
    harmonic = sum(1 / (i + 1) for i in range(n))
    for i in (0, 1, 4, 9):
        expected = draws / ((i + 1) * harmonic)
        assert abs(counts[i] - expected) < 5 * math.sqrt(expected), (i, counts[i], expected)
    assert counts[0] > 1.6 * counts[1]                         # 2x in expectation
    flat = Counter(zipf_choices(n, draws, 0.0, random.Random(3)))   # s = 0: uniform
    assert max(flat.values()) < 1.3 * draws / n


def test_lru_cold_replays_an_lru_of_the_capacity() -> None:
    seq = ["a", "b", "a", "c", "d", "a", "b", "e", "c"]
    # capacity 3: a b (a hit) c, d evicts b, a hit, b evicts c, e evicts d, c evicts a
    assert lru_cold(seq, 3) == [True, True, False, True, True, False, True, True, True]
    assert lru_cold(seq, 5) == [True, True, False, True, True, False, False, True, False]
    # seeded with resident adapters, oldest first: "x" is evicted by the first new name beyond capacity
    assert lru_cold(["a", "x", "b", "c", "x"], 2, resident=["x", "a"]) == [False, False, True, True, True]
    # the names used before are replayed: a name used twice is as recent as its last use
    assert lru_cold(["b", "a"], 2, resident=["a", "x", "a"]) == [True, False]   # b evicts x, not a
