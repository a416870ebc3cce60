"""Async scheduling: step t+1 is launched before step t's tokens are read (`core/execution/pending.py`).

The engines run on `kernel_device()`: on a GPU the steps really overlap (non-blocking copies, kernels queued
ahead); on the CPU nothing overlaps (the copies are synchronous), but the whole hand-off runs: requests carry a
placeholder token, the next step's input ids are patched from the previous step's token tensor, stops
and grammars are applied one step late, and rows of requests that just ended are dropped. Outputs must
equal HF transformers / PEFT and the synchronous engine exactly, with integrity checked after every step.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from core import LLM, SamplingParams
from core.config import CacheConfig, EngineConfig, SchedulerConfig
from core.engine.engine import LLMEngine
from core.engine.request import PENDING_TOKEN
from format_checks import strict_validate
from kernel_device import kernel_device
from testlib import PROMPTS, encode, hf_greedy, model_dir, run_staggered

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def make_engine(path: Path, async_scheduling: bool, num_blocks: int = 256, budget: int = 2048,
                prefix: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(path), dtype="float32", device=str(kernel_device()), async_scheduling=async_scheduling,
        cache=CacheConfig(block_size=16, num_blocks=num_blocks, enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget)))


def prompts_for(path: Path, num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    base = [encode(path, p) for p in PROMPTS]
    return [base[i % len(base)] + [rng.randrange(10, 500) for _ in range(rng.randint(0, 40))] for i in range(num)]


@pytest.mark.parametrize("budget,num_blocks,prefix", [(7, 256, True), (64, 20, True), (64, 20, False)])
def test_matches_hf(tiny_model: Path, budget: int, num_blocks: int, prefix: bool) -> None:
    """Chunked prefill (budget 7) and preemption by recompute (a 20-block pool), tokens equal HF's."""
    prompts = prompts_for(tiny_model, 14, seed=budget + num_blocks)
    engine = make_engine(tiny_model, True, num_blocks=num_blocks, budget=budget, prefix=prefix)
    outputs = run_staggered(engine, prompts, GREEDY, seed=3, check=True)
    if num_blocks == 20:
        assert engine.scheduler.num_preemptions > 0
    for i, ids in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(tiny_model, ids, 24), f"request {i}"
    assert engine.kv.usage() == 0.0 and not engine.scheduler.requests


def test_aborts_leak_nothing() -> None:
    """Aborting requests with a token in flight: no delta after the abort, no leaked block, and the
    other requests still equal HF."""
    path = model_dir("llama_gqa")
    prompts = prompts_for(path, 16, seed=5)
    engine = make_engine(path, True, num_blocks=24, budget=48)
    aborted: set[str] = set()
    outputs = run_staggered(engine, prompts, GREEDY, seed=7, check=True, abort_rate=0.3, aborted=aborted)
    assert 0 < len(aborted) < len(prompts)
    for i, ids in enumerate(prompts):
        if str(i) not in aborted:
            assert outputs[str(i)] == hf_greedy(path, ids, 24), f"request {i}"
    cached = engine.kv.prefix_cache.num_cached_blocks()
    assert engine.kv.usage() == 0.0 and engine.kv.allocator.num_free_blocks + cached == 24
    engine.check_integrity()


def test_tokens_arrive_one_step_late() -> None:
    """The step that samples a token returns nothing for it; the next step reads it, and its input id
    was taken from the device tensor (the host only ever held the placeholder)."""
    path = model_dir("llama_gqa")
    ids = encode(path, PROMPTS[0])
    engine = make_engine(path, True)
    req = engine.add_request("r", ids, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert engine.step() == []                                   # prefill: the token is still in flight
    assert req.num_pending_tokens == 1 and req.all_token_ids[-1] == PENDING_TOKEN
    assert req.num_computed_tokens == len(ids)
    deltas = engine.step()                                       # decode of the in-flight token
    assert [d.new_token_ids for d in deltas] == [hf_greedy(path, ids, 3, stop_at_eos=False)[:1]]
    assert req.num_pending_tokens == 1 and req.num_computed_tokens == len(ids) + 1
    rest = engine.step() + engine.step()
    assert [t for d in rest for t in d.new_token_ids] == hf_greedy(path, ids, 3, stop_at_eos=False)[1:]
    assert rest[-1].finished and not engine.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_length_limited_requests_cost_no_extra_forward(async_scheduling: bool) -> None:
    """A request whose in-flight token ends it by max_tokens is not scheduled again."""
    path = model_dir("llama_gqa")
    engine = make_engine(path, async_scheduling)
    ids = encode(path, PROMPTS[1])
    engine.add_request("r", ids, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats.num_batched_tokens == len(ids) + 5      # prefill + 5 decodes, in both modes


def test_mixed_workload_equals_sync() -> None:
    """Adapters, JSON schemas, stop strings, seeded sampling and log-probs in shared batches: the async
    engine returns exactly the synchronous engine's outputs."""
    from lora_fixtures import adapter_dir

    path = model_dir("llama_gqa")
    loras = {"a": str(adapter_dir("llama_gqa", "qv_r4")), "b": str(adapter_dir("llama_gqa", "all7_r8"))}
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    prompts = ["def f(x):", "import os", "class A:", "x = 1", "for i in", "while True:", "data = ", "# note"]
    lora = ["a", None, "b", "a", None, "b", "a", None]
    formats = [None, rf, None, {"type": "json_object"}, None, rf, None, None]
    params = [SamplingParams(max_tokens=30, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=80, temperature=0.9, seed=1),
              SamplingParams(max_tokens=30, temperature=0.7, seed=2, stop=["\n"]),
              SamplingParams(max_tokens=60, temperature=0.0),
              SamplingParams(max_tokens=25, temperature=1.0, top_p=0.9, seed=4, logprobs=1),
              SamplingParams(max_tokens=80, temperature=0.0),
              SamplingParams(max_tokens=20, temperature=0.8, top_k=5, seed=6, stop=["e"]),
              SamplingParams(max_tokens=1, temperature=0.0)]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(str(path), dtype="float32", device=str(kernel_device()), num_kv_blocks=40, max_num_seqs=5, max_loras=2,
                  lora_modules=loras, async_scheduling=async_scheduling)
        assert llm.engine.async_scheduling is async_scheduling
        outs = llm.generate(prompts, params, lora=lora, response_format=formats)
        results.append([(o.token_ids, o.text, o.finish_reason, o.outputs[0].logprobs) for o in outs])
        llm.engine.check_integrity()
        assert llm.engine.kv.usage() == 0.0
    # tokens, text and finish reasons exactly; log-prob values to fp32 batch-shape noise (the two engines
    # batch differently: requests end one step later), their token ids exactly
    assert [r[:3] for r in results[0]] == [r[:3] for r in results[1]]
    for (*_, lp0), (*_, lp1) in zip(results[0], results[1]):
        assert (lp0 is None) == (lp1 is None)
        for (t0, v0, top0), (t1, v1, top1) in zip(lp0 or [], lp1 or []):
            assert t0 == t1 and [i for i, _ in top0] == [i for i, _ in top1]
            assert v0 == pytest.approx(v1, abs=1e-4) and [v for _, v in top0] == pytest.approx([v for _, v in top1], abs=1e-4)
    num_validated = 0
    for (_, text, reason, _), fmt in zip(results[1], formats):
        if fmt is rf:   # short objects: each must finish within its 80 tokens, and validate
            assert reason == "stop", (reason, text)
            strict_validate(json.loads(text), PERSON)
            num_validated += 1
        elif fmt is not None and reason == "stop":   # json_object (a long string at 60 tokens: "length")
            assert isinstance(json.loads(text), dict), text
    assert num_validated == 2


@pytest.mark.skipif(kernel_device().type != "cuda", reason="CUDA only: a read-back of a device tensor")
def test_lm_head_of_steps_with_adapters_does_not_wait_for_the_forward() -> None:
    """On CUDA the LM head of a step with adapters and prefill chunks is queued without reading anything back from
    the device (torch's sync debug mode raises on a read-back): with one, the host waited for each such step's
    forward before it scheduled the next, and async scheduling overlapped nothing for those steps."""
    from lora_fixtures import adapter_dir

    path = model_dir("llama_gqa")
    loras = {"a": str(adapter_dir("llama_gqa", "qv_r4")), "b": str(adapter_dir("llama_gqa", "all7_r8"))}
    llm = LLM(str(path), dtype="float32", device=str(kernel_device()), max_loras=2, lora_modules=loras,
              async_scheduling=True,
              max_num_batched_tokens=32)
    sampler, real = llm.engine.sampler, llm.engine.sampler.logits
    checked: list[bool] = []

    def logits(hidden, rows, host_rows):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = real(hidden, rows, host_rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(host_rows is not None)
        return out

    sampler.logits = logits
    prompts = prompts_for(path, 6, seed=3)
    llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora=["a", None, "b", "a", "b", None])
    assert any(checked), "no step with a prefill chunk sampled"
    llm.engine.check_integrity()


def test_failed_step_leaves_no_token_in_flight() -> None:
    """A step whose forward raises (once) fails the requests of that step, drops their unread tokens and
    leaves a consistent engine: requests that come later give HF's tokens."""
    path = model_dir("llama_gqa")
    prompts = prompts_for(path, 6, seed=11)
    engine = make_engine(path, True)
    for i, ids in enumerate(prompts[:4]):
        engine.add_request(str(i), ids, GREEDY)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    errors: dict[str, str] = {}
    forward, calls = engine.model.forward, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected failure")
        return forward(*args, **kwargs)

    engine.model.forward = flaky
    while engine.has_unfinished_requests():
        for d in engine.step():
            outputs[d.request_id].extend(d.new_token_ids)
            if d.error is not None:
                errors[d.request_id] = d.error
        assert all(not r.num_pending_tokens for r in engine.scheduler.requests.values()) or engine._pending
        engine.check_integrity()
        if len(calls) == 4 and not engine.has_unfinished_requests():
            for i in (4, 5):
                engine.add_request(str(i), prompts[i], GREEDY)
    assert sorted(errors) == ["0", "1", "2", "3"] and all("injected failure" in e for e in errors.values())
    for i in (4, 5):
        assert outputs[str(i)] == hf_greedy(path, prompts[i], 24), f"request {i}"
    assert engine.kv.usage() == 0.0
