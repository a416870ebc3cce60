"""Adapters on demand (`lora_dirs`) through the engine API: 1,000 adapters in a tree, 200 distinct ones
requested at once with max_cpu_loras 32 / max_loras 4; sampled outputs equal PEFT greedy; the host LRU never
holds more than 32; unsafe names, a corrupt file and an oversize rank fail only their own requests."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from adapters.errors import CODE_CORRUPT, CODE_RANK_TOO_LARGE, AdapterError  # noqa: E402
from core import LLM, SamplingParams  # noqa: E402
from lora_fixtures import torch_threads  # noqa: E402
from lora_tree import add_corrupt, adapter_tree, peft_greedy_path, spec_of, tree_names, write_adapter  # noqa: E402
from testlib import PROMPTS, encode, model_dir  # noqa: E402

MODEL = "llama_gqa"
MAX_TOKENS = 4
MIN_MARGIN = 1e-3
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def _bad_dir(tmp: Path) -> tuple[Path, Path]:
    mpath = model_dir(MODEL)
    bad, outside = tmp / "bad", tmp / "outside"
    add_corrupt(bad, "corrupt", mpath)
    write_adapter(bad / "r128", mpath, 128, ["q_proj", "v_proj"], seed=5)
    write_adapter(outside / "evil", mpath, 4, ["q_proj"], seed=7)
    (bad / "link").symlink_to(outside / "evil")                       # a folder symlink leaving DIR
    (bad / "half").mkdir()
    write_adapter(outside / "evil2", mpath, 4, ["q_proj"], seed=8)
    shutil.copy(outside / "evil2" / "adapter_config.json", bad / "half" / "adapter_config.json")
    (bad / "half" / "adapter_model.safetensors").symlink_to(outside / "evil2" / "adapter_model.safetensors")
    return bad, outside


def _run(engine, jobs: dict[str, tuple[list[int], str | None]], max_host: int) -> tuple[dict, dict, int]:
    """Adds every job at once, steps to the end; returns tokens and errors by id, and the peak host count."""
    for rid, (ids, name) in jobs.items():
        engine.add_request(rid, ids, GREEDY, lora=engine.resolve_lora(name))
    tokens: dict[str, list[int]] = {rid: [] for rid in jobs}
    errors: dict[str, BaseException | None] = {}
    peak, steps = 0, 0
    while engine.has_unfinished_requests():
        for d in engine.step():
            tokens[d.request_id] += d.new_token_ids
            if d.error is not None:
                errors[d.request_id] = d.exception
        peak = max(peak, engine.registry.num_host)
        assert engine.registry.num_host <= max_host
        steps += 1
        if steps % 5 == 0:
            engine.check_integrity()
    engine.check_integrity()
    return tokens, errors, peak


def test_thousand_adapters_two_hundred_concurrent(tmp_path: Path) -> None:
    mpath = model_dir(MODEL)
    root = adapter_tree(mpath, 1000)
    bad, outside = _bad_dir(tmp_path)
    llm = LLM(model=str(mpath), dtype="float32", device="cpu", lora_dirs=[root, bad], max_cpu_loras=32,
              max_loras=4, max_lora_rank=64, num_kv_blocks=1024, max_num_batched_tokens=512)
    engine = llm.engine
    names = tree_names(1000)
    chosen = names[::5]                                   # 200 distinct adapters, every rank x module mix
    prompts = [encode(mpath, p) for p in PROMPTS[:4]]
    jobs = {f"r{i}": (prompts[i % len(prompts)], n) for i, n in enumerate(chosen)}
    jobs.update({"base0": (prompts[0], None), "corrupt0": (prompts[1], "corrupt"), "corrupt1": (prompts[2], "corrupt"),
                 "big": (prompts[0], "r128"), "base1": (prompts[3], None)})
    for unsafe in ("../outside/evil", "tenant-000/../../outside/evil", str(outside / "evil"), "link", "half",
                   "tenant-000/./adapter-0", "tenant-000//adapter-0", "tenant-000\\adapter-0", "", "tenant-000",
                   "tenant-000/adapter-0/adapter_config.json"):
        with pytest.raises(KeyError):
            engine.resolve_lora(unsafe)
    assert engine.registry.entries() == []                # nothing registered, nothing read

    tokens, errors, peak = _run(engine, jobs, max_host=32)
    assert peak == 32                                     # the LRU bound was reached and never exceeded
    assert set(errors) == {"corrupt0", "corrupt1", "big"}, errors
    assert isinstance(errors["corrupt0"], AdapterError) and errors["corrupt0"].code == CODE_CORRUPT
    assert (errors["corrupt1"].code, errors["corrupt1"].message) == (CODE_CORRUPT, errors["corrupt0"].message)
    assert errors["corrupt1"] is not errors["corrupt0"]   # each request raises its own copy (own traceback)
    assert isinstance(errors["big"], AdapterError) and errors["big"].code == CODE_RANK_TOO_LARGE
    assert engine.registry.stats.num_by_outcome["error"] == 2   # one read each: both corrupt requests shared one
    assert all(len(tokens[f"r{i}"]) > 0 for i in range(len(chosen)))
    assert engine.kv.usage() == 0.0 and len(engine.lora_pool.loaded_ids) <= 4

    # every sampled output equals PEFT greedy (20 adapters spread over ranks and module mixes)
    checked = 0
    for i in range(0, len(chosen), 10):
        ids, name = jobs[f"r{i}"]
        ref, margin = peft_greedy_path(mpath, root / name, ids, MAX_TOKENS)
        assert margin > MIN_MARGIN, f"test setup: near-tie in the reference of {name} {spec_of(i * 5)}"
        assert tokens[f"r{i}"] == ref, (name, spec_of(i * 5))
        checked += 1
    assert checked == 20

    # failures are remembered (no retry loop) until the files change
    with pytest.raises(AdapterError) as excinfo:
        engine.resolve_lora("corrupt")
    assert excinfo.value.code == CODE_CORRUPT and engine.registry.stats.num_by_outcome["error"] == 2
    write_adapter(bad / "corrupt", mpath, 8, ["q_proj", "v_proj"], seed=9)
    tokens, errors, _ = _run(engine, {"fixed": (prompts[0], "corrupt")}, max_host=32)
    assert not errors and tokens["fixed"] == peft_greedy_path(mpath, bad / "corrupt", prompts[0], MAX_TOKENS)[0]


def test_changed_files_need_a_new_generation(tmp_path: Path) -> None:
    """A resident adapter keeps its weights; after eviction a changed file is an error, never served under the
    old generation; unload + first request makes a new generation with the new weights."""
    mpath = model_dir(MODEL)
    root = tmp_path / "loras"
    write_adapter(root / "acme" / "a", mpath, 8, ["q_proj", "v_proj"], seed=21)
    write_adapter(root / "acme" / "b", mpath, 8, ["o_proj"], seed=22)
    old = tmp_path / "old_a"
    shutil.copytree(root / "acme" / "a", old)
    llm = LLM(model=str(mpath), dtype="float32", device="cpu", lora_dirs=[root], max_cpu_loras=1, max_loras=1,
              num_kv_blocks=256)
    engine = llm.engine
    ids = encode(mpath, PROMPTS[0])
    ref_old = peft_greedy_path(mpath, old, ids, MAX_TOKENS)[0]
    assert [o.token_ids for o in llm.generate([ids], GREEDY, lora=["acme/a"])] == [ref_old]
    gen = engine.registry.get("acme/a").generation_id
    write_adapter(root / "acme" / "a", mpath, 16, ["q_proj", "k_proj"], seed=23)
    llm.generate([ids], GREEDY, lora=["acme/b"])          # evicts a's host copy (max_cpu_loras 1)
    with pytest.raises(RuntimeError, match="changed on disk"):
        llm.generate([ids], GREEDY, lora=["acme/a"])
    engine.unload_lora("acme/a")
    ref_new = peft_greedy_path(mpath, root / "acme" / "a", ids, MAX_TOKENS)[0]
    assert ref_new != ref_old
    assert [o.token_ids for o in llm.generate([ids], GREEDY, lora=["acme/a"])] == [ref_new]
    assert engine.registry.get("acme/a").generation_id != gen
    engine.check_integrity()
    assert engine.kv.usage() == 0.0
