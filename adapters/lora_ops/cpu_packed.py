"""A slot's LoRA weights packed for oneDNN: the CPU torch path's matmuls for groups of several rows.

`torch.mm` on this project's CPU build goes to MKL, which re-blocks the weight on every call and, on an AMD CPU,
runs well below the machine's FLOP rate; the base model's linears already run on oneDNN over weights reordered
once (core/models/cpu_linear.py). LoRA's skinny products gain the most: measured on this project's 2-core
AVX-512 machine (fp32, `torch.mm` against oneDNN's `_linear_pointwise` over a reordered weight), a rank-64
expand to 4,096 columns 85 -> 31 us at 17 rows and 213 -> 83 us at 64; a fused q/k/v shrink (768 -> 96)
24 -> 17 us at 17 rows; at one or two rows oneDNN's fixed cost (about 12 us a call) loses to `torch.mm`
(4-8 us), and MKL does well on small weights. Over ranks 8-64 on q/k/v, o, gate/up and down (768 hidden,
2,048 intermediate) and 4-256 rows, the packed pair wins when its weights (sum_r x (in + N)) times
(rows + `PACKED_ROW_OFFSET`) reach `PACKED_MIN_WORK` (`use_packed`). Measured pair by pair in
`benchmarks/cpu_lora_packed.py` (`benchmarks/results/cpu_lora_packed.md`): where the rule picks the pair it is
0.86-2.8x `torch.mm` (a rank-32 gate/up 1.3-2.8x at 4-256 rows), where it keeps `torch.mm` the pair is 0.26-1.7x,
and over the whole grid the rule's choices cost 1.9% more than the better path of each shape.

    packed = packed_slot_weights(a, b)     # a [sum_r, in], b [N, sum_r]: `LoRAStack.fused_slot`'s pair
    delta = packed.apply(x)                # (x @ a.T) @ b.T, [n, N]

`LoRAStack.packed_slot` builds and caches a slot's pair; `packing_available()` says whether this torch build
has oneDNN's packed linear (x86 and aarch64 CPU builds).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

# a group takes the packed pair when weights x (rows + PACKED_ROW_OFFSET) >= PACKED_MIN_WORK and
# rows >= PACKED_MIN_ROWS: oneDNN's ~15 us more a pair of calls against MKL's re-blocking of the weights on every
# call and its lower FLOP rate
PACKED_MIN_ROWS = 4
PACKED_ROW_OFFSET = 24
PACKED_MIN_WORK = 4_300_000

@lru_cache(maxsize=1)
def packing_available() -> bool:
    """True where oneDNN's packed linear exists in this torch build."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except RuntimeError:
        return False


def use_packed(x: torch.Tensor, num_rows: int, num_weights: int) -> bool:
    """Whether `num_rows` rows of `x` times a slot's fused pair of `num_weights` elements take the packed matmuls."""
    return (num_rows >= PACKED_MIN_ROWS and num_weights * (num_rows + PACKED_ROW_OFFSET) >= PACKED_MIN_WORK
            and x.device.type == "cpu" and packing_available())

@dataclass(frozen=True)
class PackedSlot:
    """One slot's fused LoRA pair in oneDNN's blocked layout (opaque tensors)."""

    a: torch.Tensor      # packed [sum_r, in]
    b: torch.Tensor      # packed [N, sum_r], scalings folded in
    num_cols: int        # N
    num_weights: int     # sum_r x (in + N)
    dtype: torch.dtype   # the dtype x must have

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """(x @ A^T) @ B^T for x [n, in] in `dtype`: [n, N], a new tensor."""
        return self.expand(self.shrink(x))

    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        """x @ A^T for x [n, in] in `dtype`: [n, sum_r]."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.a, None, "none", [], "")

    def expand(self, h: torch.Tensor) -> torch.Tensor:
        """h @ B^T for h [n, sum_r] in `dtype`: [n, N]."""
        return torch.ops.mkldnn._linear_pointwise(h.contiguous(), self.b, None, "none", [], "")


def packed_slot_weights(a: torch.Tensor, b: torch.Tensor) -> PackedSlot:
    """Reorders a slot's fused pair (a [sum_r, in], b [N, sum_r], both in the compute dtype) for oneDNN."""
    reorder = torch.ops.mkldnn._reorder_linear_weight
    return PackedSlot(a=reorder(a.contiguous()), b=reorder(b.contiguous()), num_cols=b.shape[0],
                      num_weights=a.numel() + b.numel(), dtype=a.dtype)
