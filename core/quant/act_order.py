"""GPTQ act-order (`g_idx`) folded into the weight once at load, as GPTQ kernels do (Marlin's `perm`).

With act-order, input column k belongs to group g_idx[k] in no particular order, so a kernel reading groups in
column order would gather a scale per column. Sorting the input columns by group (stable) makes every group a
contiguous run of columns; the layer then stores its codes in that column order and permutes x's columns to match
per call (y = x[:, perm] @ W[:, perm]^T = x @ W^T): the kernel sees an ordinary grouped layer.

    perm = group_order(g_idx, num_groups, group_size)    # None: the groups cannot be made contiguous runs
    codes = codes[:, perm]                               # then x.index_select(1, perm) per call

The runs must have the layout of an ordinary grouped layer (group j = sorted columns [j * group_size, ...)): a
GPTQ checkpoint's g_idx (every group holds group_size columns) does; a tensor-parallel rank's slice of input
columns generally does not (its columns are a subset of each group), and such a layer keeps the torch path.
"""
from __future__ import annotations

import torch


def group_order(g_idx: torch.Tensor, num_groups: int, group_size: int) -> torch.Tensor | None:
    """The column order (int64 [in]) that makes group g the columns [g * group_size, (g + 1) * group_size) of
    the sorted weight, or None where the group sizes do not allow it."""
    perm = torch.sort(g_idx.long(), stable=True).indices                               # [in]
    in_features = g_idx.numel()
    expected = torch.arange(in_features, device=g_idx.device) // group_size            # [in]
    if int(g_idx.max()) >= num_groups or not torch.equal(g_idx.long()[perm], expected):
        return None
    return perm


def inverse(perm: torch.Tensor) -> torch.Tensor:
    """inv with inv[perm[j]] = j: sorted-order columns back to the checkpoint's order."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv
