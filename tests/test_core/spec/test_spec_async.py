"""A speculative config costs nothing while no request speculates: a step without drafts never enters the
verification path, and with async scheduling steps are asynchronous (tokens left in flight) exactly while no
running request speculates, synchronous while one does (its drafts need its last token on the host). Outputs
equal the synchronous engine without speculation token for token, with integrity checked every step."""
from __future__ import annotations

from core import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
LOOP = "for i in range(10):\n    print(i * i)\n" * 3
PROMPTS = [LOOP, "import os\nimport sys\nimport os\n", "The cat sat on the mat. The cat sat on the"]


def test_async_steps_only_while_no_running_request_speculates() -> None:
    kw = dict(dtype="float32", device="cpu", num_kv_blocks=128, warmup=False)
    plain = LLM(**kw)
    spec = LLM(**kw, async_scheduling=True, speculative_config={**NGRAM, "disable_by_batch_size": 1})
    eng, tok = spec.engine, spec.tokenizer
    assert eng.async_scheduling
    short, long = SamplingParams(max_tokens=12, temperature=0.0), SamplingParams(max_tokens=40, temperature=0.0)
    params = [short, long, long]
    reqs = [eng.add_request(str(i), tok.encode(p), sp) for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    assert [r.speculate for r in reqs] == [True, False, False]     # only the first speculates
    outs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    num_async = num_sync_spec = 0
    while eng.has_unfinished_requests():
        for d in eng.step():
            outs[d.request_id] += d.new_token_ids
        eng.check_integrity()
        speculating = any(r.speculate for r in eng.scheduler.running)
        if speculating:
            assert eng._pending is None         # synchronous while a speculating request runs
            num_sync_spec += 1
        num_async += eng._pending is not None
    assert num_sync_spec > 0 and num_async > 5  # both kinds of steps ran
    assert eng.stats.spec.num_accepted_tokens > 0
    want = plain.generate(PROMPTS, params)
    assert [outs[str(i)] for i in range(3)] == [w.outputs[0].token_ids for w in want]
    assert eng.kv.usage() == 0.0


def test_a_step_without_drafts_runs_the_plain_step(monkeypatch) -> None:
    """With a speculative config but no request speculating, a step never enters the verification path."""
    import core.spec.engine_step as engine_step

    def boom(*args, **kwargs):
        raise AssertionError("a step without drafts entered the speculative path")
    monkeypatch.setattr(engine_step, "draft_layout", boom)
    monkeypatch.setattr(engine_step.SpecStage, "verify", boom)
    kw = dict(dtype="float32", device="cpu", num_kv_blocks=128, warmup=False)
    spec = LLM(**kw, speculative_config=NGRAM)
    eng = spec.engine
    params = SamplingParams(max_tokens=24, temperature=0.0)
    reqs = [eng.add_request(str(i), spec.tokenizer.encode(p), params) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        r.speculate = False             # as if admitted above `disable_by_batch_size`
    outs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    while eng.has_unfinished_requests():
        for d in eng.step():
            outs[d.request_id] += d.new_token_ids
    want = LLM(**kw).generate(PROMPTS, params)
    assert [outs[str(i)] for i in range(3)] == [w.outputs[0].token_ids for w in want]
    assert eng.stats.spec.num_drafts == 0
