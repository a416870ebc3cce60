"""`scheduling_policy="priority"` through the offline API (vLLM's `generate(..., priority=[...])`): greedy fp32
outputs equal HF transformers token for token whatever the priorities, under preemption by recompute and prefix
caching; the most urgent prompt finishes first; a priority under another policy is refused before anything runs."""
from __future__ import annotations

import random

import pytest

from core.errors import RequestRejected
from engine_builders import GREEDY
from testlib import PROMPTS, encode, hf_greedy, model_dir


def test_priorities_keep_outputs_and_run_the_urgent_first() -> None:
    from core import LLM

    path = model_dir("llama_gqa")
    rng = random.Random(5)
    prompts = [list(encode(path, PROMPTS[i % len(PROMPTS)])) + [rng.randrange(10, 500) for _ in range(rng.randint(10, 60))]
               for i in range(8)]
    priorities = [rng.choice([-1, 0, 4]) for _ in prompts]
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=14, max_num_seqs=4, max_num_batched_tokens=64,
              scheduling_policy="priority", warmup=False)
    finished: list[str] = []
    step = llm.engine.step

    def recording_step():   # type: ignore[no-untyped-def]
        deltas = step()
        finished.extend(d.request_id for d in deltas if d.finished)
        llm.engine.check_integrity()
        return deltas

    llm.engine.step = recording_step   # type: ignore[method-assign]
    outputs = llm.generate(prompts, GREEDY, priority=priorities)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool never ran out: the test proved nothing"
    for ids, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(path, ids, 24)
    urgent = {f"{outputs[i].request_id}-0" for i, p in enumerate(priorities) if p == min(priorities)}
    assert set(finished[:len(urgent)]) == urgent, (priorities, finished)
    with pytest.raises(ValueError):
        llm.generate(prompts[:2], GREEDY, priority=[0])   # one per prompt
    llm.shutdown()


def test_a_priority_needs_the_priority_policy() -> None:
    from core import LLM

    llm = LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", num_kv_blocks=32, warmup=False)
    with pytest.raises(RequestRejected, match="priority"):
        llm.generate(["hello", "there"], GREEDY, priority=[0, 2])
    assert not llm.engine.has_unfinished_requests()
    llm.shutdown()


def test_numpy_priorities_are_integers_and_floats_are_refused() -> None:
    np = pytest.importorskip("numpy")
    from core import LLM

    llm = LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", num_kv_blocks=32,
              scheduling_policy="priority", warmup=False)
    outs = llm.generate(["hello", "there"], GREEDY, priority=np.array([3, -1]))
    assert all(o.outputs[0].token_ids and o.outputs[0].finish_reason in ("length", "stop") for o in outs)
    with pytest.raises(TypeError):
        llm.generate(["hello"], GREEDY, priority=[1.5])
    assert not llm.engine.has_unfinished_requests()
    llm.shutdown()
