"""One backend selection (core/environment/backends.py) for every kernel family, and no environment read in a step.

Each family's switch picks the same way (auto: Triton on CUDA when triton imports; torch; triton, refused off
CUDA unless Triton interprets); every kernel family's own choice is that selection (the LoRA and bitmask paths
are resolved in core and handed to adapters / grammar); an engine step (fused ops, LoRA dispatch, bitmask apply,
attention) reads no variable: they were read once, before."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from adapters.lora_ops import LoRABackends
from core.environment import backends
from core.environment.backends import FAMILIES, kernel_backend
from envlib import setenv


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_chooses_the_same_way(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    var = FAMILIES[family].name
    have_triton = backends.triton_available()
    for value in ("", "auto"):
        setenv(monkeypatch, var, value)
        assert kernel_backend(family, "cpu") == "torch"
        assert kernel_backend(family, "cuda") == ("triton" if have_triton else "torch")
    setenv(monkeypatch, var, "torch")
    assert kernel_backend(family, "cuda") == "torch" and kernel_backend(family, "cpu") == "torch"
    setenv(monkeypatch, var, "triton")
    if not have_triton:
        with pytest.raises(ValueError, match=f"{var}=triton needs triton"):
            kernel_backend(family, "cuda")
        return
    assert kernel_backend(family, "cuda") == "triton"
    monkeypatch.setattr(backends, "interpreting", lambda: False)   # compiled kernels: no CPU tensors
    with pytest.raises(ValueError, match=f"{var}=triton needs a CUDA device"):
        kernel_backend(family, "cpu")
    monkeypatch.setattr(backends, "interpreting", lambda: True)    # the interpreter takes CPU tensors
    assert kernel_backend(family, "cpu") == "triton"
    setenv(monkeypatch, var, "fast")
    with pytest.raises(ValueError, match=f"{var} must be auto, torch or triton"):
        kernel_backend(family, "cpu")


def test_an_explicit_choice_wins_and_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, "LORAPLEX_LORA_BACKEND", "triton")
    assert kernel_backend("lora", "cuda", "torch") == "torch"
    with pytest.raises(ValueError, match="unknown lora backend 'cutlass'"):
        kernel_backend("lora", "cpu", "cutlass")


def test_each_kernel_family_uses_the_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The families' own entry points follow their switch (a CPU tensor: torch unless forced)."""
    from core.models import fused_ops
    from core.quant import triton_gemm
    from core.sampling.grammar_masks import bitmask_backend

    x = torch.zeros(2)
    picks = {"fused": lambda: fused_ops.use_triton(x), "quant_gemm": lambda: triton_gemm.use_triton(x),
             "lora": lambda: backends.lora_backends(x.device.type)[0] == "triton",
             "bitmask": lambda: bitmask_backend(x) == "triton"}
    for family, uses_triton in picks.items():
        assert not uses_triton(), family
        if backends.triton_available() and backends.interpreting():
            setenv(monkeypatch, FAMILIES[family].name, "triton")
            assert uses_triton(), family
    setenv(monkeypatch, "LORAPLEX_ATTENTION_BACKEND", "torch")
    from core.attention.selection import get_attention_backend

    assert type(get_attention_backend(torch.device("cpu"))).__name__ == "TorchAttentionBackend"


@pytest.mark.parametrize("value, interpreting, expected", [
    ("auto", False, ("torch", "torch")), ("auto", True, ("torch", "triton")), ("torch", True, ("torch", "torch")),
    ("triton", True, ("triton", "triton")),
])
def test_the_lora_paths(value: str, interpreting: bool, expected: tuple[str, str],
                        monkeypatch: pytest.MonkeyPatch) -> None:
    """(segmented, decode) of a CPU slot pool: auto under the interpreter also runs the decode (CUDA-graph path)
    kernels, so the CPU tests exercise them; an explicit torch or triton holds for both."""
    monkeypatch.setattr(backends, "triton_available", lambda: True)
    monkeypatch.setattr(backends, "interpreting", lambda: interpreting)
    setenv(monkeypatch, "LORAPLEX_LORA_BACKEND", value)
    assert backends.lora_backends("cpu") == expected
    assert backends.lora_backends("cuda") == (("torch", "torch") if value == "torch" else ("triton", "triton"))
    monkeypatch.setattr(backends, "triton_available", lambda: False)
    if value == "triton":
        with pytest.raises(ValueError, match="LORAPLEX_LORA_BACKEND=triton needs triton"):
            backends.lora_backends("cpu")
    else:
        assert backends.lora_backends("cpu") == ("torch", "torch")


class Reads:
    """The LORAPLEX_* / TRITON_INTERPRET keys looked up in os.environ while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.keys: list[str] = []


@pytest.fixture()
def env_reads(monkeypatch: pytest.MonkeyPatch) -> Reads:
    reads = Reads()
    environ_class = type(os.environ)
    getitem = environ_class.__getitem__

    def counting(self: Any, key: str) -> Any:
        if reads.on and (key.startswith("LORAPLEX_") or key == "TRITON_INTERPRET"):
            reads.keys.append(key)
        return getitem(self, key)

    monkeypatch.setattr(environ_class, "__getitem__", counting)   # get, getenv and `in` go through it
    return reads


def test_an_engine_step_reads_no_variable(env_reads: Reads) -> None:
    """Issue 32: LORAPLEX_FUSED_OPS was read on every fused-op call, the LoRA switch on every LoRA op."""
    pytest.importorskip("peft")
    from core import LLM, SamplingParams
    from lora_fixtures import adapter_dir
    from testlib import model_dir

    llm = LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", num_kv_blocks=32, max_num_seqs=2,
              lora_modules={"a": str(adapter_dir("llama_gqa", "qv_r4"))}, warmup=False)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    json_object = {"type": "json_object"}
    run = dict(lora=["a", None], response_format=[json_object, None])   # LoRA ops, a grammar mask, fused ops
    llm.generate(["a b c", "d e"], params, **run)   # every variable read once
    # handed down, with LORAPLEX_LORA_OVERLAP's default (on; it only acts on the Triton decode path)
    assert llm.engine.lora_pool.context.backends == LoRABackends(*backends.lora_backends("cpu"), overlap=True)
    env_reads.on = True
    out = llm.generate(["a b c", "d e"], params, **run)
    env_reads.on = False
    assert all(o.outputs[0].token_ids for o in out)
    assert env_reads.keys == [], f"read during the steps: {sorted(set(env_reads.keys))}"
