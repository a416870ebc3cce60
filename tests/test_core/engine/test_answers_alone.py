"""Each request's answer is a function of the request alone, end to end: seeded sampling (top-p, top-k, min-p,
penalties, bias, n = 3, a JSON schema) and greedy, on the base and on adapters (one with LoRA on the LM head), with
logprobs and prompt logprobs, give alone on a plain engine what they give among other requests (random
parameters, adapters, schemas and logprobs, in random order) on engines configured otherwise: no prefix cache and
5-token prefill chunks; a pool so small that requests are preempted, async scheduling and one adapter slot.
(Speculative decoding: tests/test_core/spec/test_spec_outputs.py; the sampler's own invariants:
tests/test_core/sampling/test_batch_invariance.py.)"""
from __future__ import annotations

import random

import pytest

from testlib import model_dir
from core import LLM, SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning",
                                        "ignore:Setting `save_embedding_layers`:UserWarning")

SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
    "type": "object", "properties": {"answer": {"type": "string", "enum": ["forty-two"]}},
    "required": ["answer"], "additionalProperties": False}}}


PROMPT = "def fibonacci(n):\n    return"
OTHERS = ["import os\nimport sys\n\n" * 3, "x", "class Cache:\n    def __init__(self, size):\n" * 5,
          "for i in range(9):"]


def _targets() -> list[tuple[str, SamplingParams, str | None, dict | None]]:
    return [
        ("seeded", SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=123, logprobs=3,
                                  prompt_logprobs=2, ignore_eos=True), None, None),
        ("adapter+penalties", SamplingParams(max_tokens=12, temperature=0.9, top_k=30, seed=55, logprobs=2,
                                             presence_penalty=0.3, logit_bias={5: 2.0}, ignore_eos=True), "a", None),
        ("schema", SamplingParams(max_tokens=24, temperature=1.0, seed=77, logprobs=2), None, SCHEMA),
        ("greedy vocab adapter", SamplingParams(max_tokens=12, temperature=0.0, logprobs=4, prompt_logprobs=1,
                                                ignore_eos=True), "b", None),
        ("n=3", SamplingParams(max_tokens=12, temperature=1.0, seed=1, n=3, logprobs=1, min_p=0.02, top_p=0.9,
                               ignore_eos=True), "b", None),
    ]


def _mixed(llm: LLM, target: SamplingParams, lora: str | None, schema: dict | None, seed: int) -> object:
    """`target` on PROMPT among OTHERS with random parameters, adapters and schemas, in a random order."""
    rng = random.Random(seed)
    params = [SamplingParams(max_tokens=rng.randint(3, 20), temperature=rng.choice([0.0, 0.7, 1.3]),
                             seed=rng.randint(0, 99), top_p=rng.choice([1.0, 0.8]), min_p=rng.choice([0.0, 0.1]),
                             frequency_penalty=rng.choice([0.0, 0.5]), logprobs=rng.choice([None, 0, 5]),
                             n=rng.choice([1, 2])) for _ in OTHERS] + [target]
    loras = [rng.choice([None, "a", "b"]) for _ in OTHERS] + [lora]
    schemas = [rng.choice([None, SCHEMA]) for _ in OTHERS] + [schema]
    order = list(range(len(params)))
    rng.shuffle(order)
    outs = llm.generate([(OTHERS + [PROMPT])[i] for i in order], [params[i] for i in order],
                        lora=[loras[i] for i in order], response_format=[schemas[i] for i in order])
    return outs[order.index(len(params) - 1)]


def _same(a: object, b: object) -> None:
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    for oa, ob in zip(a.outputs, b.outputs):
        for ea, eb in zip(oa.logprobs or [], ob.logprobs or []):
            assert ea[1] == pytest.approx(eb[1], abs=1e-4)
            assert [t for t, _ in ea[2]] == [t for t, _ in eb[2]]
    for ea, eb in zip(a.prompt_logprobs or [], b.prompt_logprobs or []):
        assert (ea is None) == (eb is None)
        if ea is not None:
            assert ea[1] == pytest.approx(eb[1], abs=1e-4) and [t for t, _ in ea[2]] == [t for t, _ in eb[2]]


@pytest.fixture(scope="module")
def adapters_and_answers() -> tuple[dict[str, str], list]:
    """The adapters ("a": LoRA on q/v, "b": on the embeddings, the LM head and q) and each target's answer alone
    on a plain engine."""
    pytest.importorskip("peft")
    from lora_fixtures import adapter_dir

    loras = {"a": str(adapter_dir("llama_gqa", "qv_r4")), "b": str(adapter_dir("llama_gqa", "vocab_r8"))}
    with LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", warmup=False, num_kv_blocks=256,
             lora_modules=loras) as plain:
        answers = [plain.generate([PROMPT], params, lora=lora, response_format=schema)[0]
                   for _, params, lora, schema in _targets()]
    return loras, answers


@pytest.mark.parametrize("config", [
    dict(enable_prefix_caching=False, max_num_batched_tokens=5),
    dict(num_kv_blocks=10, max_num_batched_tokens=32, async_scheduling=True, max_loras=1)],
    ids=["no-prefix-cache,chunk-5", "preemption,async,max-loras-1"])
def test_outputs_are_the_request_alone(config: dict, adapters_and_answers: tuple[dict[str, str], list]) -> None:
    loras, answers = adapters_and_answers
    with LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", warmup=False,
             lora_modules=loras, **{"num_kv_blocks": 256, **config}) as varied:
        for i, ((name, params, lora, schema), alone) in enumerate(zip(_targets(), answers)):
            assert len({tuple(o.token_ids) for o in alone.outputs}) == params.n, name   # n choices differ
            _same(_mixed(varied, params, lora, schema, seed=i), alone)
        if config.get("num_kv_blocks") == 10:
            assert varied.engine.scheduler.num_preemptions > 0
