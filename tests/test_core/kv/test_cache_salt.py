"""vLLM's `cache_salt`: prefix-cache KV is shared only among requests with the same salt (and adapter load), so
one tenant cannot tell from time to first token whether another's prompt is cached; outputs never change."""
from __future__ import annotations

import pytest

from testlib import PROMPTS, encode, model_dir
from core import LLM, SamplingParams
from core.sampling.params import SamplingParamsError

PATH = model_dir("llama_gqa")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(PATH), dtype="float32", device="cpu", num_kv_blocks=128)


def _run(llm: LLM, prompt: list[int], salt: str | None) -> tuple[list[int], int]:
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, cache_salt=salt))[0]
    llm.engine.check_integrity()
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_only_the_same_salt_reuses_the_cache(llm: LLM) -> None:
    prompt = encode(PATH, PROMPTS[2] * 4)
    assert len(prompt) > 48
    want, cached = _run(llm, prompt, "tenant-a")
    assert cached == 0
    assert _run(llm, prompt, "tenant-a") == (want, (len(prompt) - 1) // 16 * 16)   # a hit: every full block
    assert _run(llm, prompt, "tenant-b") == (want, 0)      # another salt: no hit, the same answer
    assert _run(llm, prompt, None) == (want, 0)            # no salt: the shared cache, not the salted one
    assert _run(llm, prompt, None)[1] > 0
    # vLLM's prompt-dict key
    out = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-b"}],
                       SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == want and out.num_cached_tokens > 0


def test_many_salts_leave_no_namespaces_behind(llm: LLM) -> None:
    prompt = encode(PATH, PROMPTS[3] * 3)
    for i in range(40):   # each salt fills its own namespace; the pool (128 blocks) evicts the oldest
        _run(llm, prompt, f"salt-{i}")
    cache = llm.engine.kv.prefix_cache
    assert cache is not None
    cache.evict(llm.engine.kv.num_blocks)
    assert not cache.roots
    llm.engine.check_integrity()


@pytest.mark.parametrize("salt", ["", "x" * 1025])
def test_bad_salts_name_the_field(salt: str) -> None:
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(cache_salt=salt)
    assert err.value.param == "cache_salt"


def test_an_adapter_unload_clears_its_salted_namespaces() -> None:
    from lora_fixtures import adapter_dir   # noqa: PLC0415 - needs peft: imported where used

    llm = LLM(str(PATH), dtype="float32", device="cpu", num_kv_blocks=128)
    try:
        llm.engine.load_lora("tenant", str(adapter_dir("llama_gqa", "qv_r4")))
        prompt = encode(PATH, PROMPTS[2] * 4)
        for salt in (None, "tenant-a", "tenant-b"):
            llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, cache_salt=salt),
                         lora="tenant")
        cache = llm.engine.kv.prefix_cache
        assert cache is not None
        namespace = llm.engine.resolve_lora("tenant").namespace
        assert sum(name.startswith(namespace) for name in cache.roots) == 3
        llm.engine.unload_lora("tenant")
        llm.engine.step()   # the step releases what the unloaded adapter held: its KV under every salt too
        assert not [name for name in cache.roots if name.startswith(namespace)]
        llm.engine.check_integrity()
    finally:
        llm.engine.shutdown()
