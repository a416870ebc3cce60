"""The multi-LoRA engine cases shared by the LoRA, speculative-decoding and tensor-parallel tests.

    llm = make_llm("llama_gqa", max_loras=2)          # LLM with tenant-a / tenant-b / tenant-d loaded
    check_mixed("llama_gqa", llm, rounds=2)           # base + every adapter in one batch == PEFT greedy
    prompts, loras = mixed_batch("llama_gqa")         # p0/base, p0/tenant-a, ..., p1/base, ...
    reference("llama_gqa", "tenant-b", ids)           # PEFT greedy tokens, clear of near-ties

Three adapters (ranks 4 / 8 / 16; q,v / all seven / rsLoRA on k,o,down) so every batch spreads over device
slots 0, 1 and 2 (tests/helpers/lora_fixtures.py builds them with `peft`).
"""
from __future__ import annotations

from core import LLM, SamplingParams
from lora_fixtures import adapter_dir, peft_greedy, peft_greedy_margin
from testlib import PROMPTS, encode, model_dir

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
MIN_MARGIN = 1e-3  # fp32 engine vs PEFT differ by ~1e-5 in the logits; references must be clear of ties
SYSTEM = "# You are a helpful assistant that writes short, correct Python code.\n" * 2
# chosen so every reference (base and each adapter, both models) has a top-1/top-2 gap > MIN_MARGIN
TEXTS = [PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[7], SYSTEM + "def add(a, b):", SYSTEM + "# sort a list"]
# served name -> fixture adapter (ranks 4 / 8 / 16; q,v / all seven / rsLoRA on k,o,down)
NAMES = {"tenant-a": "qv_r4", "tenant-b": "all7_r8", "tenant-d": "rs_kod_r16"}
LORAS: list[str | None] = [None, *NAMES]


def prompt_ids(model: str) -> list[list[int]]:
    return [encode(model_dir(model), t) for t in TEXTS]


def reference(model: str, lora: str | None, ids: list[int], names: dict[str, str] = NAMES) -> list[int]:
    adapter = None if lora is None else names[lora]
    margin = peft_greedy_margin(model, adapter, ids, MAX_TOKENS)
    assert margin > MIN_MARGIN, f"test setup: PEFT greedy top-1/top-2 gap {margin} too small ({adapter})"
    return peft_greedy(model, adapter, ids, MAX_TOKENS)


def make_llm(model: str, names: dict[str, str] | None = None, **kw) -> LLM:
    names = NAMES if names is None else names
    args = dict(dtype="float32", device="cpu", max_loras=8, max_lora_rank=64, max_num_batched_tokens=2048,
                num_kv_blocks=256, enable_prefix_caching=True)
    args.update(kw)
    return LLM(model=str(model_dir(model)), lora_modules={n: str(adapter_dir(model, a)) for n, a in names.items()},
               **args)


def generate(llm: LLM, prompts: list[list[int]], loras: list[str | None]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora=loras)
    assert len(outs) == len(prompts)
    for out in outs:
        assert out.finish_reason in ("stop", "length")
    return [list(o.token_ids) for o in outs]


def assert_idle_and_sound(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    assert llm.engine.kv.usage() == 0.0


def mixed_batch(model: str) -> tuple[list[list[int]], list[str | None]]:
    """Every prompt under the base and under every adapter, interleaved: p0/base, p0/a, ..., p1/base, ..."""
    prompts, loras = [], []
    for ids in prompt_ids(model):
        for lora in LORAS:
            prompts.append(ids)
            loras.append(lora)
    return prompts, loras


def check_mixed(model: str, llm: LLM, rounds: int = 1) -> list[list[int]]:
    prompts, loras = mixed_batch(model)
    for r in range(rounds):  # a second round runs against a warm prefix cache in every namespace
        got = generate(llm, prompts, loras)
        for i, (ids, lora, out) in enumerate(zip(prompts, loras, got)):
            expected = reference(model, lora, ids)
            assert out == expected, (
                f"round {r} request {i}: model={model} lora={lora} ({NAMES.get(lora or '', 'base')}) "
                f"prompt={TEXTS[i // len(LORAS)]!r}\n expected {expected}\n got      {out}")
        llm.engine.check_integrity()
    assert_idle_and_sound(llm)
    return got
