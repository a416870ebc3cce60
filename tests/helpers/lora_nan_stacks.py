"""LoRA stacks for the kernel tests (tests/test_adapters/test_lora_bgmv*.py), on `kernel_device()`: random A and B
with NaN past each slot's rank, so a kernel that reads beyond a row's real rank poisons its output.

    stack = nan_stack(num_slots=4, r_max=16, in_f=48, outs=(32, 16, 16), ranks=[[16, 8, 4, 0], ...])
"""
from __future__ import annotations

import torch

from adapters.lora_ops import LoRAStack
from kernel_device import kernel_device

DEVICE = kernel_device()


def nan_stack(num_slots: int, r_max: int, in_f: int, outs: tuple[int, ...], ranks: list[list[int]],
              dtype: torch.dtype = torch.float32, seed: int = 0) -> LoRAStack:
    g = torch.Generator().manual_seed(seed)
    S = len(outs)
    a = torch.randn(S, num_slots, r_max, in_f, generator=g) * 0.5      # [S, slots, R, in]
    b = torch.randn(num_slots, sum(outs), r_max, generator=g) * 0.5    # [slots, N, R]
    for s in range(S):
        off = sum(outs[:s])
        for k in range(num_slots):
            a[s, k, ranks[s][k]:] = float("nan")
            b[k, off:off + outs[s], ranks[s][k]:] = float("nan")
    scal = torch.rand(S, num_slots, generator=g) + 0.5
    return LoRAStack(lora_a=a.to(dtype).to(DEVICE), lora_b=b.to(dtype).to(DEVICE),
                     ranks=torch.tensor(ranks, dtype=torch.int32, device=DEVICE), scalings=scal.to(DEVICE),
                     slice_offsets=tuple(sum(outs[:s]) for s in range(S)), slice_sizes=outs,
                     ranks_host=torch.tensor(ranks, dtype=torch.int32), scalings_host=scal)
