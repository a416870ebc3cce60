"""Tensor parallelism (gloo, CPU, fp32, N=2) with async scheduling: step t+1 is sent to the worker before the
driver reads step t's tokens, so the worker patches its inputs from the tokens the driver broadcasts after
sampling. Greedy outputs equal HF / PEFT token for token with mixed adapters (also one found in a `--lora-dir`),
chunked prefill and preemption (a small KV pool); prompt log-probs (whose LM-head rows the worker joins) equal N=1."""
from __future__ import annotations

import math
import shutil
from typing import Iterator

import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from core import LLM, SamplingParams  # noqa: E402
from lora_fixtures import adapter_dir, torch_threads  # noqa: E402
from lora_engine_cases import check_mixed, generate, make_llm, prompt_ids, reference  # noqa: E402
from testlib import PROMPTS, encode, hf_greedy, model_dir, run_staggered  # noqa: E402

MODEL = "llama_gqa"


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    lora_dir = tmp_path_factory.mktemp("loras")
    shutil.copytree(adapter_dir(MODEL, "all7_r8"), lora_dir / "acme" / "support")
    with torch_threads(1):
        engine = make_llm(MODEL, max_loras=2, tensor_parallel_size=2, async_scheduling=True,
                          max_num_batched_tokens=48, lora_dirs=[str(lora_dir)],
                          num_kv_blocks=24)        # ~5 of the mixed batch's 24 requests fit: preemption
        try:
            yield engine
        finally:
            engine.shutdown()


def test_async_is_on_under_tp(llm: LLM) -> None:
    assert llm.engine.executor.has_workers and llm.engine.async_scheduling


def test_mixed_adapters_match_peft(llm: LLM) -> None:
    """With rows in flight when their request is preempted (recomputed later, on both ranks)."""
    before = llm.engine.scheduler.num_preemptions
    check_mixed(MODEL, llm)
    assert llm.engine.scheduler.num_preemptions > before
    llm.engine.check_integrity()


def test_directory_adapter_loads_on_first_request(llm: LLM) -> None:
    """`--lora-dir` works under TP: the driver's registry reads the adapter, the slot write reaches the worker."""
    ids = prompt_ids(MODEL)[:2]
    assert generate(llm, ids, ["acme/support"] * 2) == [
        reference(MODEL, "acme/support", p, {"acme/support": "all7_r8"}) for p in ids]


def test_staggered_batch_matches_hf(llm: LLM) -> None:
    """Requests join while others decode: most steps mix rows whose input token is still in flight."""
    path = model_dir(MODEL)
    prompts = [encode(path, p) + [10 + i, 20 + i] for i, p in enumerate(PROMPTS)]   # as test_tp_parity's
    outputs = run_staggered(llm.engine, prompts, SamplingParams(max_tokens=24, temperature=0.0), check=True)
    for i, ids in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(path, ids, 24), f"request {i}"
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.usage() == 0.0


def test_prompt_logprobs_equal_tp1(llm: LLM) -> None:
    ids = prompt_ids(MODEL)[4]                        # long enough to be prefilled in chunks of 48
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    with torch_threads(1):
        one = LLM(str(model_dir(MODEL)), dtype="float32", device="cpu", num_kv_blocks=256,
                  max_num_batched_tokens=48)
        want = one.generate([{"prompt_token_ids": ids}], params)[0].prompt_logprobs
    got = llm.generate([{"prompt_token_ids": ids}], params)[0].prompt_logprobs
    assert got is not None and want is not None and len(got) == len(want) == len(ids)
    assert got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g[0] == w[0] and math.isclose(g[1], w[1], rel_tol=1e-4, abs_tol=1e-4)
        assert [t for t, _ in g[2]] == [t for t, _ in w[2]]
