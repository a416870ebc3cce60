"""The step's adapters stacked into one pair of matrices: the CPU torch path's LoRA for small decode batches.

A decode step on the CPU is bound by the calls it makes, not by its FLOPs: on latency_slo.py's 768-hidden
8-layer model a decode step of 8 rows took 7.8 ms on the base model, 10.4-11.7 ms with one adapter and 12.9 ms with
three, where the adapters' weights are under 1 ms of memory traffic. The per-adapter path (`torch_grouped`'s fused
path) makes per wrapped linear a gather of the LoRA rows, two matmuls per adapter and a scatter into y.

Stacked, every adapter of the step is one block of columns of one pair,

    A = [A_1; A_2; ...]        [C, in]     (each slot's `LoRAStack.fused_slot` A: all its slices at their ranks)
    B = [B_1, B_2, ...]        [N, C]      (each slot's scaled, slice-placed B)

so that h = x @ A.T computes every row against every adapter of the step, the columns of the other adapters are
zeroed in h (`masked_fill_`, a mask built once per step and column layout), and y += h @ B.T adds each row's own
delta, into y's columns directly when the LoRA rows are at least half of the step's: two matmuls and a fill per
linear whatever the number of adapters, no gather, no scatter (the base rows then get exact zeros added: their
values are unchanged, a -0.0 becomes +0.0). A row's delta is its adapter's alone: the other adapters' columns of
h are exact zeros (a fill, not a product, so a non-finite A of another adapter cannot reach the row), and a stacked
B with a non-finite value is never built (`stacked_weights` returns None and the per-adapter path runs), so no
0 x inf reaches a row of another tenant.

The extra FLOPs (every row against every adapter's columns) are bounded by `stacked_pays`: at most
`STACKED_MAX_ADAPTERS` adapters and `STACKED_MAX_ROWS` LoRA rows, the regime where the calls cost more than the
FLOPs (measured in benchmarks/cpu_lora_stacked.py; results/cpu_lora_stacked.md).

Which adapters a pair holds: while the pool has at most `STACKED_MAX_ADAPTERS` adapters with a rank on the linear,
all of them (`LoRAStack.stacking_slots`: one pair for every mix, so a step whose mix changed never rebuilds pairs on
its clock), else the step's own. A row's delta is the same in every case up to rounding: a wider pair (more
columns of other adapters, exact zeros in h) can change the matmul's blocking and so the last bits of a row's
result, as the step's mix already could; it never changes which weights reach the row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from adapters.lora_ops.cpu_packed import PackedSlot, packed_slot_weights, use_packed
from adapters.lora_ops.metadata import ColumnLayout

STACKED_MAX_ADAPTERS = 4   # adapters of a step the stacked pair takes (each adds its columns to every row's work)
STACKED_MAX_ROWS = 64      # LoRA rows of a step the stacked pair takes (beyond, the per-adapter matmuls' FLOPs win)
STACKED_MAX_WORK = 32_000_000   # the most rows x stacked weights (C x (in + N)) a linear takes stacked
STACKED_CACHE_SIZE = 4     # own-mix stacked pairs kept per linear (one per recent set of the step's adapters), and
                           # the pool's pair besides, which is never evicted
OWN_PAIR_AFTER_STEPS = 64  # a mix's own pair is built once it ran this many steps in a row (else the pool's pair)


@dataclass(frozen=True)
class StackedSlots:
    """Some slots' fused LoRA pairs side by side, one block of columns per slot with a rank on this linear, in
    `layout`'s order."""

    a: torch.Tensor                 # [C, in] in the compute dtype
    b: torch.Tensor                 # [N, C], scalings folded in
    layout: ColumnLayout            # (slot, columns) of each block: the key of the step's mask
    packed: Optional[PackedSlot]    # the pair in oneDNN's layout (None: this torch build has no packed linear)

    @property
    def num_weights(self) -> int:
        return self.a.numel() + self.b.numel()

    @property
    def num_cols(self) -> int:
        return self.b.shape[0]

    def uses_packed(self, x: torch.Tensor) -> bool:
        """Whether `x`'s rows take the oneDNN pair (`cpu_packed.use_packed`) rather than `torch.mm`."""
        return self.packed is not None and use_packed(x, x.shape[0], self.packed.num_weights)

    def products(self, x: torch.Tensor, off_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """x [n, in] (compute dtype) times A, the columns of other slots zeroed: h [n, C]."""
        if self.uses_packed(x):
            assert self.packed is not None
            h = self.packed.shrink(x)                                                             # [n, C]
        else:
            h = x @ self.a.t()                                                                    # [n, C]
        if off_mask is not None:
            h.masked_fill_(off_mask, 0.0)
        return h

    def expand(self, h: torch.Tensor) -> torch.Tensor:
        """h [n, C] times B: the deltas [n, N], a new tensor."""
        if self.uses_packed(h):
            assert self.packed is not None
            return self.packed.expand(h)                                                          # [n, N]
        return h @ self.b.t()                                                                     # [n, N]


def stacked_weights(slots: Sequence[int], pairs: Sequence[Optional[tuple[torch.Tensor, torch.Tensor]]],
                    pack: bool) -> Optional[StackedSlots]:
    """The slots' fused pairs (`LoRAStack.fused_slot`, None for a slot without rank on this linear) side by side;
    None when no slot has a rank here or the stacked B holds a non-finite value (the per-adapter path then keeps
    each adapter's values to its own rows). `pack`: also reorder the pair for oneDNN."""
    live = [(slot, pair) for slot, pair in zip(slots, pairs) if pair is not None]
    if not live:
        return None
    a = torch.cat([pair[0] for _, pair in live])                                  # [C, in]
    b = torch.cat([pair[1] for _, pair in live], dim=1)                           # [N, C]
    if not bool(torch.isfinite(b).all()):
        return None
    layout = tuple((slot, pair[0].shape[0]) for slot, pair in live)
    return StackedSlots(a=a, b=b, layout=layout, packed=packed_slot_weights(a, b) if pack else None)
