"""The engine's side of structured generation: mask the logits of constrained rows, advance matchers.

The model never sees the grammar; this module only touches the logits of rows whose request carries
a `grammar.GrammarMatcher`, with one batched bitmask apply per step, on the path LORAPLEX_BITMASK_BACKEND names
for the logits' device (`bitmask_backend`: the Triton kernel for CUDA logits by default, torch otherwise). The
sampling stage takes its masks through `TokenMasker` (`GrammarMasks` here).
"""
from __future__ import annotations

from typing import Protocol

import torch

from core.engine import faults
from core.environment.backends import Backend, kernel_backend
from core.errors import RequestFault
from core.engine.request import Request
from grammar.matching.bitmask import allocate_token_bitmask, apply_token_bitmask_


class GrammarViolation(RuntimeError):
    """A sampled token the grammar did not allow (a bug: masks make this impossible)."""


TokenMasks = tuple[torch.Tensor, torch.Tensor]   # bitmask [N, ceil(V/32)] int32, constrained rows [R] int64


class TokenMasker(Protocol):
    """What the sampling stage asks of structured generation: the masks of a batch's rows, then their apply."""

    def fill(self, reqs: list[Request]) -> TokenMasks | None: ...

    def apply(self, logits: torch.Tensor, masks: TokenMasks | None) -> None: ...


class GrammarMasks:
    """`TokenMasker` of the requests' grammar matchers over a vocabulary of `vocab_size` logits."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def fill(self, reqs: list[Request]) -> TokenMasks | None:
        return fill_token_masks(reqs, self.vocab_size)

    def apply(self, logits: torch.Tensor, masks: TokenMasks | None) -> None:
        apply_token_masks(logits, masks)


def fill_token_masks(reqs: list[Request], vocab_size: int) -> TokenMasks | None:
    """Host side (runs while the forward is on the GPU): the bitmask of the sampled rows; None if no row is
    constrained."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.status.finished]
    if not rows:
        return None

    bitmask = allocate_token_bitmask(len(reqs), vocab_size)               # [N, ceil(V/32)] all ones
    for i in rows:
        if faults.ACTIVE:
            faults.hit("grammar_fill", reqs[i])
        reqs[i].grammar.fill_bitmask(bitmask, i)
        if not bitmask[i].any():
            raise RequestFault(f"the output constraint (grammar, schema or regex) allows no token after "
                               f"{reqs[i].num_output_tokens} generated tokens: it has no way to go on", status=400,
                               code="grammar_dead_end")
    return bitmask, torch.tensor(rows, dtype=torch.int64)


def bitmask_backend(logits: torch.Tensor) -> Backend:
    """The path of the bitmask apply on `logits` (LORAPLEX_BITMASK_BACKEND, read once; core/environment/backends.py)."""
    return kernel_backend("bitmask", logits.device.type)


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks | None) -> None:
    """logits [N, V] of the sampled rows, masked in place where the request is constrained."""
    if masks is None:
        return

    bitmask, rows = masks
    if logits.is_cuda:
        bitmask, rows = bitmask.pin_memory(), rows.pin_memory()
    apply_token_bitmask_(logits, bitmask.to(logits.device, non_blocking=True),
                         rows.to(logits.device, non_blocking=True), backend=bitmask_backend(logits))



def advance_grammar(req: Request, token: int) -> bool:
    """Feeds the sampled token to the request's matcher; True when the output is complete
    (EOS/stop accepted in a final state, or a state where only EOS remains)."""
    matcher = req.grammar
    if faults.ACTIVE:
        faults.hit("grammar_advance", req)
    if not matcher.accept_token(token):
        raise GrammarViolation(f"request {req.request_id}: token {token} is not allowed by its grammar")
    return matcher.is_terminated()
