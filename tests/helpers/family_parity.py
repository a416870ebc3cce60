"""One combined engine-vs-reference check per model family (tests/test_core/models/test_family_*.py).

    adapters = family_adapters(path, tmp / "adapters", "qwen3", all7_adapter_path, seeds=(52, 52))
    check_family(path, adapters, texts, prefix=True)

Base and adapter rows share every batch; a small token budget chunks the prefills; a small KV pool forces
preemption by recompute; with prefix caching a second round runs against a warm cache; the run without
prefix caching uses async scheduling (step t+1 planned before step t's tokens are read). References: HF
transformers greedy for the base, `PeftModel` greedy for adapters (fp32, CPU), each clear of near-ties.
Three adapters (tests/helpers/lora_slots.py): each changes the greedy output, and the batch puts them in
three device slots, so a delta lost or mixed up in any slot other than 0 fails the check.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

from core import LLM, SamplingParams
from lora_fixtures import _save_adapter
from lora_slots import adapter_slots, assert_adapters_matter, assert_slots_spread
from lora_tree import greedy_with_margin, peft_greedy_path
from testlib import _hf_model, encode

MAX_TOKENS = 16
MIN_MARGIN = 1e-3  # fp32 engine vs reference differ by ~1e-5 in the logits
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
ATTN_TARGETS = ["q_proj", "v_proj"]
MLP_TARGETS = ["gate_proj", "up_proj", "down_proj"]


def reference(path: Path, adapter: Path | None, prompt_ids: list[int]) -> list[int]:
    if adapter is None:
        tokens, margin = greedy_with_margin(_hf_model(str(path)), prompt_ids, MAX_TOKENS)
    else:
        tokens, margin = peft_greedy_path(path, adapter, prompt_ids, MAX_TOKENS)
    assert margin > MIN_MARGIN, f"test setup: reference near a tie ({adapter}, gap {margin})"
    return tokens


ReferenceFn = Callable[[Path, "Path | None", list[int]], list[int]]


def family_adapters(path: Path, out: Path, name: str, primary: Path, seeds: tuple[int, int],
                    attn_targets: list[str] | str = ATTN_TARGETS,
                    mlp_targets: list[str] | str = MLP_TARGETS) -> dict[str, Path]:
    """The family's own adapter (`primary`, usually all seven projections) between two more made with `peft`:
    rank 4 on attention projections and rank 16 rsLoRA on the MLP (`seeds`: theirs, picked so every reference
    clears MIN_MARGIN). In a batch's order they take slots 0, 1 (the primary) and 2."""
    base = _hf_model(str(path))
    attn = _save_adapter(copy.deepcopy(base), dict(r=4, lora_alpha=8, target_modules=attn_targets), 1.5, seeds[0],
                         out / f"{name}-attn-r4")
    mlp = _save_adapter(copy.deepcopy(base), dict(r=16, lora_alpha=8, use_rslora=True, target_modules=mlp_targets),
                        1.0, seeds[1], out / f"{name}-mlp-r16")
    return {f"{name}-attn-r4": attn, f"{name}-all7": primary, f"{name}-mlp-r16": mlp}


def check_family(path: Path, adapters: dict[str, Path], texts: list[str], prefix: bool,
                 reference_fn: ReferenceFn = reference, **llm_kwargs: object) -> LLM:
    """Every text under the base and under every adapter in one batch, chunked prefill, preemption;
    two rounds with prefix caching on (the second hits the cache); without it, async scheduling.
    Returns the engine (shut down if TP)."""
    args: dict[str, object] = dict(dtype="float32", device="cpu", max_loras=4, max_lora_rank=16,
                                   max_num_batched_tokens=24, num_kv_blocks=24, block_size=8,
                                   enable_prefix_caching=prefix, async_scheduling=not prefix)
    args.update(llm_kwargs)
    llm = LLM(str(path), lora_modules={n: str(p) for n, p in adapters.items()}, **args)  # type: ignore[arg-type]
    try:
        _check_rounds(llm, path, adapters, texts, prefix, reference_fn)
    finally:
        llm.engine.executor.shutdown()   # the workers (no-op at one rank); the engine stays readable
    return llm


def _check_rounds(llm: LLM, path: Path, adapters: dict[str, Path], texts: list[str], prefix: bool,
                  reference_fn: ReferenceFn) -> None:
    rows = [(encode(path, t), lora) for t in texts for lora in (None, *adapters)]
    expected = [reference_fn(path, None if lora is None else adapters[lora], ids) for ids, lora in rows]
    assert_adapters_matter([e for e, (_, lora) in zip(expected, rows) if lora is None],
                           {n: [e for e, (_, lora) in zip(expected, rows) if lora == n] for n in adapters})
    for round_ in range(2 if prefix else 1):
        outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in rows], GREEDY, lora=[lo for _, lo in rows])
        slots = adapter_slots(llm.engine, adapters)
        for i, ((ids, lora), out, ref) in enumerate(zip(rows, outs, expected)):
            slot = "" if lora is None else f" (slot {slots[lora]})"
            assert list(out.token_ids) == ref, \
                f"round {round_} row {i} lora={lora}{slot}\n expected {ref}\n got {out.token_ids}"
        assert_slots_spread(slots)
        llm.engine.check_integrity()
    assert llm.engine.scheduler.num_preemptions > 0, "test setup: the KV pool should force preemption"
    assert llm.engine.kv.usage() == 0.0
    if prefix:
        assert llm.engine.kv.num_prefix_hit_tokens > 0
