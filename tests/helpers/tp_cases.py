"""Tensor-parallel engines and their HF checks, shared by tests/test_core/distributed/.

    for llm in tp_llm("llama_gqa", 2):        # an LLM over N ranks (gloo, CPU, fp32), shut down afterwards
        check_hf(llm, "llama_gqa", PROMPTS)   # greedy tokens == HF transformers
"""
from __future__ import annotations

import threading
from typing import Iterator

import psutil
import torch

from core import LLM, SamplingParams
from testlib import encode, hf_greedy, model_dir

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def tp_llm(name: str, size: int, **kw) -> Iterator[LLM]:
    """The engine; its shutdown leaves no worker process, thread or process group behind."""
    threads, children = set(threading.enumerate()), {p.pid for p in psutil.Process().children(recursive=True)}
    llm = LLM(str(model_dir(name)), dtype="float32", device="cpu", num_kv_blocks=256, tensor_parallel_size=size,
              **kw)
    try:
        yield llm
    finally:
        llm.shutdown()
    left = [(p.pid, p.cmdline()) for p in psutil.Process().children(recursive=True)
            if p.pid not in children and "resource_tracker" not in " ".join(p.cmdline())]  # multiprocessing's own
    assert not left, left
    left_threads = [t.name for t in set(threading.enumerate()) - threads if t.name != "tqdm_monitor"]  # HF's bars
    assert not left_threads, left_threads
    assert not torch.distributed.is_initialized()


def check_hf(llm: LLM, name: str, prompts: list[str]) -> None:
    path = model_dir(name)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, encode(path, prompt), 24), (name, prompt)
