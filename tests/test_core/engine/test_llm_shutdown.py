"""`LLM.shutdown()` and `with LLM(...) as llm:` release what the engine holds (issue 33 item 3): the threads it
started (adapter loader pool, grammar compile threads), its child processes (grammar compile workers), every
reference to its tensors (model, KV caches, LoRA slots; on CUDA `memory_allocated()` returns to where it was), and
a second engine then builds and generates in the same process. The finding: after `del llm`, a second `LLM(...)`
ran out of GPU memory with 78.3 GiB still allocated. Dropping the last reference (`del llm`, as vLLM scripts do)
releases the same: it left the grammar compile worker processes and their threads running for the life of the
process."""
from __future__ import annotations

import gc
import threading
import weakref

import psutil
import pytest
import torch

from core import LLM, SamplingParams
from kernel_device import kernel_device
from lora_fixtures import adapter_dir
from testlib import model_dir

MODEL = "llama_gqa"
DEVICE = kernel_device().type
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


def _threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def _allocated() -> int:
    """CUDA memory held by tensors, less torch's own cuBLAS workspaces: torch keeps one per (handle, stream) it
    ran a GEMM on, for the life of the process (32 MiB each on Hopper), and a CUDA graph capture runs on a side
    stream: on the H200 the first shutdown left exactly one more 32 MiB block than the snapshot, torch's, not the
    engine's."""
    if DEVICE != "cuda":
        return 0
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    return torch.cuda.memory_allocated()


def _build() -> LLM:
    # host LRU of one adapter for two: serving "a" re-reads it on the adapter loader pool's threads
    return LLM(str(model_dir(MODEL)), dtype="float32", device=DEVICE, num_kv_blocks=64, max_cpu_loras=1,
               lora_modules={"a": str(adapter_dir(MODEL, "qv_r4")), "b": str(adapter_dir(MODEL, "all7_r8"))})


def _serve(llm: LLM) -> list[list[int]]:
    """A grammar compile (compile worker processes) and an adapter load (loader threads), then a plain request."""
    outs = llm.generate(["hello", "hello"], GREEDY, lora=["a", None], response_format=[{"type": "json_object"}, None])
    assert llm.engine.grammar_compiler.worker_pids, "the compile workers ran"
    return [o.outputs[0].token_ids for o in outs]


def test_shutdown_releases_threads_processes_and_memory_and_a_second_engine_serves() -> None:
    model_dir(MODEL), adapter_dir(MODEL, "qv_r4"), adapter_dir(MODEL, "all7_r8")   # written before the snapshot
    gc.collect()
    threads, children, allocated = _threads(), _children(), _allocated()

    llm = _build()
    first = _serve(llm)
    assert _threads() - threads and _children() - children, "the engine's threads and workers existed"
    head = llm.engine.model.lm_head
    held = [weakref.ref(t) for t in (*(list(head.buffers()) or [head.weight]),      # a CPU head's packed weight
                                     llm.engine.model.model.embed_tokens.weight, llm.engine.kv_caches[0][0])]
    del head
    held.append(weakref.ref(llm.engine.model))
    llm.shutdown()
    llm.shutdown()                                   # idempotent
    gc.collect()
    assert not _threads() - threads, [t.name for t in _threads() - threads]
    assert _children() == children
    assert all(ref() is None for ref in held), "a reference to the engine's tensors survived the shutdown"
    assert _allocated() == allocated
    with pytest.raises(RuntimeError):                # no compile after the shutdown (its workers are gone)
        llm.engine.grammar_compiler

    with _build() as second:                         # builds and generates in the same process
        assert _serve(second) == first
    gc.collect()
    assert not _threads() - threads, [t.name for t in _threads() - threads]
    assert _children() == children
    assert _allocated() == allocated


def test_dropping_the_last_reference_releases_the_engine() -> None:
    model_dir(MODEL), adapter_dir(MODEL, "qv_r4"), adapter_dir(MODEL, "all7_r8")
    gc.collect()
    threads, children, allocated = _threads(), _children(), _allocated()
    llm = _build()
    _serve(llm)
    assert _children() - children, "the compile workers ran"
    engine = weakref.ref(llm.engine)
    del llm                                          # no shutdown(), no with block
    gc.collect()
    assert engine() is None
    assert not _threads() - threads, [t.name for t in _threads() - threads]
    assert _children() == children
    assert _allocated() == allocated
