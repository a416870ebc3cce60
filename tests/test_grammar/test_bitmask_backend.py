"""The bitmask apply's two paths: the torch one (any device) and the Triton kernel agree, and the apply takes the
path its caller names; LORAPLEX_BITMASK_BACKEND, resolved by the engine's sampler (core/sampling/grammar_masks.py),
picks the path it names (the torch one is what the start-up self-check points to on a GPU whose kernel failed)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from core.sampling import grammar_masks  # noqa: E402
from envlib import setenv  # noqa: E402
from grammar.matching import bitmask as bm  # noqa: E402
from grammar.matching import bitmask_triton  # noqa: E402
from kernel_device import kernel_device  # noqa: E402

DEVICE = kernel_device()


@pytest.fixture()
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which implementation each apply ran."""
    seen: list[str] = []
    triton_apply, torch_apply = bitmask_triton.apply_token_bitmask_triton_, bm.apply_token_bitmask_torch_

    def spy_triton(*args: object) -> None:
        seen.append("triton")
        triton_apply(*args)

    def spy_torch(*args: object) -> None:
        seen.append("torch")
        torch_apply(*args)

    monkeypatch.setattr(bitmask_triton, "apply_token_bitmask_triton_", spy_triton)
    monkeypatch.setattr(bm, "apply_token_bitmask_torch_", spy_torch)
    return seen


def _apply(backend: str, logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    out = logits.clone()
    bm.apply_token_bitmask_(out, mask, rows, backend=backend)   # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("vocab", [77, 128, 1000])
@pytest.mark.parametrize("use_rows", [False, True])
def test_torch_and_triton_paths_agree(vocab: int, use_rows: bool, calls: list[str]) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen).to(DEVICE)
    mask = torch.randint(-(2 ** 31), 2 ** 31 - 1, (5, (vocab + 31) // 32), generator=gen,
                         dtype=torch.int64).to(torch.int32).to(DEVICE)
    mask[1] = -1                                                       # a row that allows everything
    rows = torch.tensor([4, 0, 1], device=DEVICE) if use_rows else None
    by_torch = _apply("torch", logits, mask, rows)
    by_triton = _apply("triton", logits, mask, rows)
    assert calls == ["torch", "triton"]
    assert torch.equal(by_torch, by_triton)
    masked = torch.isinf(by_torch)
    assert masked.any() and not masked.all()                           # the masks did something
    if use_rows:
        assert not masked[[2, 3]].any()                                # rows not listed are untouched


def test_the_path_is_the_callers(calls: list[str]) -> None:
    logits, mask = torch.zeros(1, 40), torch.zeros(1, 2, dtype=torch.int32)
    bm.apply_token_bitmask_(logits, mask)                          # unnamed: the torch reference, on any device
    assert calls == ["torch"] and torch.isinf(logits).all()
    with pytest.raises(ValueError, match="unknown bitmask backend 'auto'"):
        bm.apply_token_bitmask_(logits, mask, backend="auto")      # type: ignore[arg-type]  # core resolves auto


def test_the_switch(calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    logits, mask = torch.zeros(1, 40), torch.zeros(1, 2, dtype=torch.int32)
    for value, expected in (("", "torch"), ("auto", "torch"), ("torch", "torch"), (" Torch ", "torch")):
        setenv(monkeypatch, "LORAPLEX_BITMASK_BACKEND", value)
        assert grammar_masks.bitmask_backend(logits) == expected  # CPU logits: auto is torch
    cuda_logits = SimpleNamespace(device=SimpleNamespace(type="cuda"))   # all the choice reads of the logits
    for value, expected in (("", "triton"), ("torch", "torch"), ("triton", "triton")):
        setenv(monkeypatch, "LORAPLEX_BITMASK_BACKEND", value)
        assert grammar_masks.bitmask_backend(cuda_logits) == expected   # type: ignore[arg-type]  # auto: triton
    setenv(monkeypatch, "LORAPLEX_BITMASK_BACKEND", "cuda")
    with pytest.raises(ValueError, match="LORAPLEX_BITMASK_BACKEND must be auto, torch or triton"):
        grammar_masks.bitmask_backend(logits)


@pytest.mark.parametrize("value", ["torch", "triton"])
def test_the_sampler_takes_the_switch(value: str, calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's apply (core/sampling/grammar_masks.py) runs the path the switch names, on the kernel device."""
    setenv(monkeypatch, "LORAPLEX_BITMASK_BACKEND", value)
    logits = torch.zeros(3, 40, device=DEVICE)
    mask = torch.zeros(3, 2, dtype=torch.int32)
    mask[1] = -1                                                       # row 1 allows everything
    grammar_masks.apply_token_masks(logits, (mask, torch.tensor([0, 1])))
    assert calls == [value]
    assert torch.isinf(logits[0]).all() and not torch.isinf(logits[1:]).any()
