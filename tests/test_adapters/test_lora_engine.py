"""Multi-LoRA end to end through `LLM.generate`: greedy outputs equal `PeftModel` (fp32) token for
token with the base and every adapter mixed in one batch, with prefix caching on, with fewer device
slots than adapters in use, across chunked prefill; prefix-cache namespaces; hot load / unload /
reload; rejected adapters leave the engine serving."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from adapters.errors import (  # noqa: E402
    CODE_CORRUPT, CODE_RANK_TOO_LARGE, CODE_SHAPE_MISMATCH, AdapterError, AdapterNotFoundError,
)
from testlib import encode, model_dir  # noqa: E402
from core import LLM  # noqa: E402
from lora_engine_cases import (  # noqa: E402
    GREEDY, LORAS, NAMES, SYSTEM, TEXTS, assert_idle_and_sound, check_mixed, generate, make_llm, mixed_batch,
    prompt_ids, reference,
)
from lora_fixtures import adapter_dir, corrupt_adapter_dir, torch_threads, wrong_base_adapter_dir  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):  # tiny model: one thread is as fast when idle and far faster on a busy box
        yield


# ---- 1. all adapters and the base mixed in one batch, prefix caching on --------------------------
@pytest.mark.parametrize("model", ["llama_gqa", "qwen2_tied"])
def test_mixed_batch_matches_peft(model: str) -> None:
    llm = make_llm(model)
    hits_before = llm.engine.kv.num_prefix_hit_tokens
    check_mixed(model, llm, rounds=2)
    assert llm.engine.kv.num_prefix_hit_tokens > hits_before  # the second round used the cache


# ---- 2. fewer device slots than adapters in use ---------------------------------------------------
@pytest.mark.parametrize("max_loras", [1, 2])
def test_mixed_batch_with_few_slots(max_loras: int, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = make_llm("llama_gqa", max_loras=max_loras)
    engine, pool = llm.engine, llm.engine.lora_pool
    assert pool.num_slots == max_loras
    writes: list[object] = []       # adapter ids written into a slot (a load that was not resident)
    per_step: set[object] = set()   # distinct adapters the current step put in slots
    widest = [0]
    real_load, real_step = pool.load, engine.step

    def load(adapter_id, *args, **kwargs):
        if pool.slot_of(adapter_id) is None:
            writes.append(adapter_id)
        per_step.add(adapter_id)
        return real_load(adapter_id, *args, **kwargs)

    def step():
        per_step.clear()
        out = real_step()
        widest[0] = max(widest[0], len(per_step))
        return out

    monkeypatch.setattr(pool, "load", load)
    monkeypatch.setattr(engine, "step", step)
    check_mixed("llama_gqa", llm)
    assert 1 <= widest[0] <= max_loras, f"{widest[0]} distinct adapters in one step with max_loras={max_loras}"
    assert len(set(writes)) == len(NAMES) and len(writes) > max_loras, f"no slot eviction: writes {writes}"


# ---- 3. chunked prefill ------------------------------------------------------------------------
def test_mixed_batch_chunked_prefill() -> None:
    llm = make_llm("llama_gqa", max_num_batched_tokens=8, max_loras=2)
    check_mixed("llama_gqa", llm)


def test_lm_head_lora_rows_never_read_back_from_the_device() -> None:
    """The LM head's LoRA learns the sampled rows of every step from host indices: a device tensor read back there
    would make the host wait for the step's forward (on a GPU with async scheduling: no overlap of the next step's
    scheduling with this one for any step with prefill and adapters). Outputs stay PEFT's."""
    import numpy as np
    import torch

    llm = make_llm("llama_gqa", max_num_batched_tokens=24)        # prefill chunks beside decode rows
    sampler = llm.engine.sampler
    real = sampler.logit_rows
    seen: list[type] = []

    def recording(rows):
        seen.append(type(rows))
        return real(rows)

    sampler.logit_rows = recording
    check_mixed("llama_gqa", llm)
    assert seen and torch.Tensor not in seen, f"LM-head rows given as {set(seen)}"
    assert np.ndarray in seen, "no step named its sampled rows (every step sampled all of its rows?)"


# ---- 4. the adapters really change the output -------------------------------------------------
@pytest.mark.parametrize("model", ["llama_gqa", "qwen2_tied"])
def test_adapters_change_outputs(model: str) -> None:
    prompts = prompt_ids(model)
    base_refs = [reference(model, None, ids) for ids in prompts]
    for lora in NAMES:
        refs = [reference(model, lora, ids) for ids in prompts]
        differ = sum(r != b for r, b in zip(refs, base_refs))
        assert differ >= len(prompts) - 1, f"{lora}: only {differ}/{len(prompts)} references differ from base"
    llm = make_llm(model)
    got = generate(llm, [prompts[0]] * len(LORAS), LORAS)
    assert len({tuple(g) for g in got}) == len(LORAS), f"engine outputs not all distinct: {got}"
    assert_idle_and_sound(llm)


# ---- 5. prefix-cache namespaces ---------------------------------------------------------------
def test_prefix_cache_namespaces() -> None:
    model = "llama_gqa"
    llm = make_llm(model)
    kv = llm.engine.kv
    ids = encode(model_dir(model), SYSTEM + "def main():")
    assert len(ids) > 2 * llm.engine.block_size
    base_ref, a_ref = reference(model, None, ids), reference(model, "tenant-a", ids)
    assert base_ref != a_ref

    assert generate(llm, [ids], [None]) == [base_ref]           # fills the base namespace
    hits = kv.num_prefix_hit_tokens
    out = llm.generate([{"prompt_token_ids": ids}], GREEDY, lora=["tenant-a"])[0]
    assert out.token_ids == a_ref, "adapter request served from the base namespace's KV?"
    assert kv.num_prefix_hit_tokens == hits and out.num_cached_tokens == 0, "cross-namespace prefix hit"

    out = llm.generate([{"prompt_token_ids": ids}], GREEDY, lora=["tenant-a"])[0]
    assert out.token_ids == a_ref
    assert kv.num_prefix_hit_tokens > hits and out.num_cached_tokens > 0, "same adapter, same prompt: no hit"
    hits = kv.num_prefix_hit_tokens

    out = llm.generate([{"prompt_token_ids": ids}], GREEDY, lora=["tenant-b"])[0]
    assert out.token_ids == reference(model, "tenant-b", ids)
    assert kv.num_prefix_hit_tokens == hits and out.num_cached_tokens == 0, "cross-adapter prefix hit"

    out = llm.generate([{"prompt_token_ids": ids}], GREEDY, lora=[None])[0]
    assert out.token_ids == base_ref and out.num_cached_tokens > 0
    assert_idle_and_sound(llm)


# ---- 6. hot load / unload / reload with different weights -------------------------------------
def test_hot_load_unload_reload() -> None:
    model = "llama_gqa"
    llm = make_llm(model, names={"tenant-a": "qv_r4"})
    engine = llm.engine
    prompts = prompt_ids(model)[:4]  # no two share a full block: any prefix hit would be stale
    v1 = {"tenant-c": "all7_r8"}
    v2 = {"tenant-c": "all7_r8_v2"}
    refs_v1 = [reference(model, "tenant-c", p, v1) for p in prompts]
    refs_v2 = [reference(model, "tenant-c", p, v2) for p in prompts]
    assert refs_v1 != refs_v2

    with pytest.raises(Exception) as excinfo:  # not loaded yet
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, lora=["tenant-c"])
    assert "tenant-c" in str(excinfo.value)
    assert not engine.has_unfinished_requests()

    engine.load_lora("tenant-c", str(adapter_dir(model, "all7_r8")))
    assert generate(llm, prompts, ["tenant-c"] * len(prompts)) == refs_v1
    assert generate(llm, prompts, ["tenant-c"] * len(prompts)) == refs_v1  # warm cache, same weights
    assert_idle_and_sound(llm)

    engine.unload_lora("tenant-c")
    with pytest.raises(Exception) as excinfo:
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, lora=["tenant-c"])
    assert isinstance(excinfo.value, (ValueError, KeyError, LookupError, AdapterError)), repr(excinfo.value)
    assert "tenant-c" in str(excinfo.value)
    assert not engine.has_unfinished_requests()
    # the other adapter and the base are unaffected
    assert generate(llm, prompts[:2], ["tenant-a", None]) == [
        reference(model, "tenant-a", prompts[0]), reference(model, None, prompts[1])]

    engine.load_lora("tenant-c", str(adapter_dir(model, "all7_r8_v2")))
    hits = engine.kv.num_prefix_hit_tokens
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora=["tenant-c"] * len(prompts))
    for i, (out, r1, r2) in enumerate(zip(outs, refs_v1, refs_v2)):
        assert out.token_ids == r2, (f"prompt {TEXTS[i]!r} after reload: expected the new weights' {r2}, "
                                     f"got {out.token_ids} (old weights' output: {r1})")
        assert out.num_cached_tokens == 0, f"prompt {i}: stale prefix-cache hit after reload"
    assert engine.kv.num_prefix_hit_tokens == hits
    # mixed with the base and the other adapter in one batch, on a warm cache
    assert generate(llm, prompts[:3], ["tenant-c", None, "tenant-a"]) == [
        refs_v2[0], reference(model, None, prompts[1]), reference(model, "tenant-a", prompts[2])]
    assert_idle_and_sound(llm)


def test_unload_while_in_flight() -> None:
    """Unload removes the name at once; requests already running on it finish with its weights."""
    model = "llama_gqa"
    llm = make_llm(model, names={"tenant-a": "qv_r4"})
    engine = llm.engine
    prompts = prompt_ids(model)[:3]
    engine.load_lora("tenant-c", str(adapter_dir(model, "all7_r8")))
    entry = engine.resolve_lora("tenant-c")
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, GREEDY, lora=entry)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(3):  # prefill + a couple of decode steps
        for d in engine.step():
            outputs[d.request_id].extend(d.new_token_ids)
    assert all(outputs.values()) and engine.has_unfinished_requests()
    engine.unload_lora("tenant-c")
    with pytest.raises(Exception) as excinfo:
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, lora=["tenant-c"])
    assert "tenant-c" in str(excinfo.value)
    while engine.has_unfinished_requests():
        for d in engine.step():
            outputs[d.request_id].extend(d.new_token_ids)
        engine.check_integrity()
    for i, ids in enumerate(prompts):
        assert outputs[f"r{i}"] == reference(model, "tenant-c", ids, {"tenant-c": "all7_r8"}), f"prompt {i}"
    # the name is free again: a new load with other weights is served from its own namespace
    engine.load_lora("tenant-c", str(adapter_dir(model, "all7_r8_v2")))
    assert generate(llm, prompts, ["tenant-c"] * len(prompts)) == [
        reference(model, "tenant-c", ids, {"tenant-c": "all7_r8_v2"}) for ids in prompts]
    assert_idle_and_sound(llm)


def test_reload_while_the_old_weights_run_never_shares_their_kv() -> None:
    """The anchors' stale-KV bug: a reload under the same name while a request of the old weights still runs
    (its prompt blocks are in the radix tree). The new weights' request on the same prompt gets no prefix hit
    (namespaces are generation ids, never names) and the new weights' tokens; the old request finishes with
    the old weights'."""
    model = "llama_gqa"
    llm = make_llm(model, names={"tenant-a": "qv_r4"})
    engine = llm.engine
    ids = prompt_ids(model)[4]                      # several full blocks
    engine.load_lora("tenant-c", str(adapter_dir(model, "all7_r8")))
    engine.add_request("old", ids, GREEDY, lora=engine.resolve_lora("tenant-c"))
    outputs: dict[str, list[int]] = {"old": [], "new": []}
    cached: dict[str, int] = {}
    for _ in range(2):                              # the prefill (its blocks go into the tree) and a decode step
        for d in engine.step():
            outputs[d.request_id] += d.new_token_ids
    assert engine.has_unfinished_requests()
    engine.unload_lora("tenant-c")
    engine.load_lora("tenant-c", str(adapter_dir(model, "all7_r8_v2")))
    engine.add_request("new", ids, GREEDY, lora=engine.resolve_lora("tenant-c"))
    while engine.has_unfinished_requests():
        for d in engine.step():
            outputs[d.request_id] += d.new_token_ids
            cached[d.request_id] = d.num_cached_tokens
        engine.check_integrity()
    assert cached["new"] == 0, "the reloaded adapter hit the old weights' KV"
    assert outputs["new"] == reference(model, "tenant-c", ids, {"tenant-c": "all7_r8_v2"})
    assert outputs["old"] == reference(model, "tenant-c", ids, {"tenant-c": "all7_r8"})
    assert_idle_and_sound(llm)


def test_replace_in_place_while_the_old_weights_run() -> None:
    """vLLM's `load_inplace`: a load with `replace` over a loaded name. A request resolved before the swap and
    admitted after it runs on the new weights (never a 404: the name never stopped existing); the request
    already running finishes on the old weights; the new weights never hit the old KV; a failed replace leaves
    the old weights serving; without `replace` the name is a duplicate."""
    model = "llama_gqa"
    llm = make_llm(model, names={"tenant-a": "qv_r4"})
    engine = llm.engine
    ids = prompt_ids(model)[4]
    engine.load_lora("tenant-c", str(adapter_dir(model, "all7_r8")))
    with pytest.raises(AdapterError) as excinfo:
        engine.load_lora("tenant-c", str(adapter_dir(model, "all7_r8_v2")))
    assert excinfo.value.code == "duplicate_adapter"
    with pytest.raises(AdapterError):               # a bad replacement: the old entry stays
        engine.load_lora("tenant-c", str(corrupt_adapter_dir(model)), replace=True)
    engine.add_request("old", ids, GREEDY, lora=engine.resolve_lora("tenant-c"))
    resolved_early = engine.resolve_lora("tenant-c")
    outputs: dict[str, list[int]] = {"old": [], "late": [], "new": []}
    cached: dict[str, int] = {}
    for _ in range(2):
        for d in engine.step():
            outputs[d.request_id] += d.new_token_ids
    engine.load_lora("tenant-c", str(adapter_dir(model, "all7_r8_v2")), replace=True)
    engine.registry.check_integrity()
    engine.add_request("late", ids, GREEDY, lora=resolved_early)   # resolved before the swap
    engine.add_request("new", ids, GREEDY, lora=engine.resolve_lora("tenant-c"))
    while engine.has_unfinished_requests():
        for d in engine.step():
            outputs[d.request_id] += d.new_token_ids
            cached.setdefault(d.request_id, d.num_cached_tokens)
        engine.check_integrity()
    new_ref = reference(model, "tenant-c", ids, {"tenant-c": "all7_r8_v2"})
    assert outputs["old"] == reference(model, "tenant-c", ids, {"tenant-c": "all7_r8"})
    assert outputs["late"] == new_ref and outputs["new"] == new_ref
    assert cached["late"] == 0, "the replacement hit the old weights' KV"
    assert [e.name for e in engine.registry.entries()].count("tenant-c") == 1
    assert_idle_and_sound(llm)


def test_replace_of_a_name_not_loaded_is_a_load() -> None:
    model = "llama_gqa"
    llm = make_llm(model, names={"tenant-a": "qv_r4"})
    engine = llm.engine
    entry = engine.load_lora("tenant-d", str(adapter_dir(model, "all7_r8")), replace=True)
    assert engine.resolve_lora("tenant-d") is entry
    ids = prompt_ids(model)[0]
    engine.add_request("r", ids, GREEDY, lora=entry)
    out: list[int] = []
    while engine.has_unfinished_requests():
        for d in engine.step():
            out += d.new_token_ids
    assert out == reference(model, "tenant-d", ids, {"tenant-d": "all7_r8"})
    assert_idle_and_sound(llm)


def test_unload_between_resolve_and_admission() -> None:
    """The gateway resolves a name, then the engine thread admits the request: an unload in between is a 404
    for that request (its slot and host copy may already be freed), never a request that waits forever."""
    model = "llama_gqa"
    llm = make_llm(model, names={"tenant-a": "qv_r4"})
    engine = llm.engine
    engine.load_lora("tenant-c", str(adapter_dir(model, "all7_r8")))
    entry = engine.resolve_lora("tenant-c")
    engine.unload_lora("tenant-c")
    engine.step()                                   # the engine frees the unloaded adapter's slot and copy
    with pytest.raises(AdapterError) as excinfo:
        engine.add_request("late", prompt_ids(model)[0], GREEDY, lora=entry)
    assert excinfo.value.status == 404 and excinfo.value.code == "model_not_found"
    assert entry.num_in_flight == 0 and not engine.has_unfinished_requests()
    assert_idle_and_sound(llm)


def test_request_submitted_before_unload_finishes() -> None:
    """Through the server's path (`AsyncEngine.submit` holds the adapter on the event loop): an unload after
    the submission and before the engine thread admits it lets the request finish with the adapter's weights
    (it is in flight), and a submission after the unload is a 404 raised before any response starts."""
    import asyncio
    import threading

    from core.engine.async_engine import AsyncEngine

    model = "llama_gqa"
    llm = make_llm(model, names={"tenant-a": "qv_r4"})
    engine = llm.engine
    engine.load_lora("tenant-c", str(adapter_dir(model, "all7_r8")))
    entry = engine.resolve_lora("tenant-c")
    ids = prompt_ids(model)[0]
    aeng = AsyncEngine(engine, owns_engine=False)     # the engine is checked after the loop stops
    gate, parked = threading.Event(), threading.Event()

    def park() -> None:                                # holds the engine thread between two iterations
        if not gate.is_set():
            parked.set()
            gate.wait(30)

    aeng.hooks.append(park)
    aeng.start()
    assert parked.wait(30)

    async def run() -> list[int]:
        queue = aeng.submit("r", ids, GREEDY, lora=entry)
        engine.unload_lora("tenant-c")
        with pytest.raises(AdapterError) as excinfo:
            aeng.submit("late", ids, GREEDY, lora=entry)
        assert excinfo.value.status == 404
        gate.set()
        tokens: list[int] = []
        while True:
            delta = await asyncio.wait_for(queue.get(), 60)
            assert delta.error is None, delta.error
            tokens += delta.new_token_ids
            if delta.finished:
                return tokens

    try:
        tokens = asyncio.run(run())
    finally:
        gate.set()
        aeng.shutdown()
    assert tokens == reference(model, "tenant-c", ids, {"tenant-c": "all7_r8"})
    assert entry.num_in_flight == 0
    engine.step()                                      # frees the unloaded adapter's slot
    assert_idle_and_sound(llm)


@pytest.mark.parametrize("unload_after_steps", [0, 1])
def test_unload_while_waiting_for_its_host_copy(unload_after_steps: int) -> None:
    """A request admitted on an adapter whose host copy was evicted (host LRU of 1) waits for the re-read; an
    unload before or during that read must not cancel it: the request finishes with the adapter's weights."""
    model = "llama_gqa"
    names = {"tenant-a": "qv_r4", "tenant-b": "all7_r8"}
    llm = make_llm(model, names=names, max_cpu_loras=1)
    engine = llm.engine
    entry = engine.resolve_lora("tenant-a")
    assert not entry.ready, "test setup: tenant-a's host copy should have been evicted by tenant-b's load"
    ids = prompt_ids(model)[1]
    engine.add_request("r", ids, GREEDY, lora=entry)
    tokens: list[int] = []
    for step in range(10_000):
        if step == unload_after_steps:
            engine.unload_lora("tenant-a")
        if not engine.has_unfinished_requests():
            break
        for d in engine.step():
            assert d.error is None, d.error
            tokens += d.new_token_ids
        engine.check_integrity()
    assert not engine.has_unfinished_requests(), "the request never got its adapter back"
    assert tokens == reference(model, "tenant-a", ids, names)
    assert engine.resolve_lora("tenant-b") is not None and engine.registry.get("tenant-a") is None
    assert_idle_and_sound(llm)


def test_failed_generate_leaves_no_orphans() -> None:
    """One unknown adapter in a list rejects the call without leaving the valid ones queued."""
    model = "llama_gqa"
    llm = make_llm(model)
    ids = prompt_ids(model)[0]
    with pytest.raises(Exception) as excinfo:
        llm.generate([{"prompt_token_ids": ids}] * 3, GREEDY, lora=["tenant-a", None, "tenant-zz"])
    assert "tenant-zz" in str(excinfo.value)
    assert not llm.engine.has_unfinished_requests()
    assert generate(llm, [ids, ids], ["tenant-a", None]) == [reference(model, "tenant-a", ids),
                                                              reference(model, None, ids)]
    assert_idle_and_sound(llm)


# ---- 7. rejected adapters: clear errors, the engine keeps serving ---------------------------
def _bad_adapters(model: str, tmp: Path) -> list[tuple[str, Path, type, str | None, str]]:
    """(served name, path, exception type, AdapterError.code or None, a word the message must contain)"""
    return [
        ("bad-rank", adapter_dir(model, "big_r96"), AdapterError, CODE_RANK_TOO_LARGE, "rank"),
        ("bad-missing", tmp / "no_such_adapter", AdapterNotFoundError, "adapter_not_found", "not found"),
        ("bad-corrupt", corrupt_adapter_dir(model), AdapterError, CODE_CORRUPT, "safetensors"),
        ("bad-base", wrong_base_adapter_dir(), AdapterError, CODE_SHAPE_MISMATCH, "lora_"),
    ]


def test_rejected_adapters_keep_engine_serving(tmp_path: Path) -> None:
    model = "llama_gqa"
    llm = make_llm(model, names={"tenant-a": "qv_r4"})
    engine = llm.engine
    ids = prompt_ids(model)[4]
    expected = [reference(model, "tenant-a", ids), reference(model, None, ids)]
    assert generate(llm, [ids, ids], ["tenant-a", None]) == expected
    for name, path, exc_type, code, word in _bad_adapters(model, tmp_path):
        with pytest.raises(exc_type) as excinfo:
            engine.load_lora(name, str(path))
        err = excinfo.value
        assert err.code == code, f"{name}: code {err.code!r}, message {err.message!r}"
        assert err.status == (404 if exc_type is AdapterNotFoundError else 400)
        assert word.lower() in str(err).lower(), f"{name}: unclear message {str(err)!r}"
        with pytest.raises(Exception) as excinfo:  # the failed name was not registered
            llm.generate([{"prompt_token_ids": ids}], GREEDY, lora=[name])
        assert name in str(excinfo.value)
        assert not engine.has_unfinished_requests()
        assert generate(llm, [ids, ids], ["tenant-a", None]) == expected, f"engine broken after {name}"
    with pytest.raises(AdapterError) as excinfo:  # duplicate name
        engine.load_lora("tenant-a", str(adapter_dir(model, "all7_r8")))
    assert excinfo.value.status == 400 and "tenant-a" in str(excinfo.value)
    assert generate(llm, [ids, ids], ["tenant-a", None]) == expected  # still the original weights
    # a good adapter still loads after all the failures
    engine.load_lora("tenant-b", str(adapter_dir(model, "all7_r8")))
    assert generate(llm, [ids, ids, ids], ["tenant-b", "tenant-a", None]) == [
        reference(model, "tenant-b", ids), *expected]
    assert_idle_and_sound(llm)


def test_rejected_adapter_at_startup() -> None:
    model = "llama_gqa"
    with pytest.raises(AdapterError) as excinfo:
        LLM(model=str(model_dir(model)), dtype="float32", device="cpu", num_kv_blocks=64, max_lora_rank=64,
            lora_modules={"tenant-a": str(adapter_dir(model, "qv_r4")),
                          "bad-rank": str(adapter_dir(model, "big_r96"))})
    assert excinfo.value.code == CODE_RANK_TOO_LARGE


# ---- 8. one engine through everything: integrity and no leaked blocks at the end -------------
def test_long_session_integrity(tmp_path: Path) -> None:
    model = "llama_gqa"
    llm = make_llm(model, max_loras=2, max_num_batched_tokens=64, num_kv_blocks=64)
    engine = llm.engine
    prompts, loras = mixed_batch(model)
    for round_ in range(2):
        got = generate(llm, prompts, loras)
        assert got == [reference(model, lora, ids) for ids, lora in zip(prompts, loras)], f"round {round_}"
        engine.check_integrity()
    engine.load_lora("tenant-c", str(adapter_dir(model, "all7_r8_v2")))
    for _, path, exc_type, _, _ in _bad_adapters(model, tmp_path):
        with pytest.raises(exc_type):
            engine.load_lora("tenant-x", str(path))
    engine.unload_lora("tenant-b")
    names = {**NAMES, "tenant-c": "all7_r8_v2"}
    loras = [None, "tenant-a", "tenant-c", "tenant-d"] * (len(prompts) // 4)
    got = generate(llm, prompts, loras)
    assert got == [reference(model, lora, ids, names) for ids, lora in zip(prompts, loras)]
    assert_idle_and_sound(llm)
