"""Per-layer buffers whose every layer view starts on a 16-byte boundary.

The slot pool keeps each fused group's weights and tables as one buffer [L, ...] and hands the kernels the
layer views `buffer[i]`. Triton specializes every pointer argument on 16-byte alignment, so a layer view that
starts off that boundary is another compiled kernel variant. With a contiguous buffer, layer i starts at
i x (elements per layer) x (element size) bytes: the int32 `ranks` [L, S, slots] of 3 slots (S = 1, 2 or 3) puts
layer 1 at 12, 24 or 36 bytes, and only layer 0 matches the start-up warm-up's launches (fresh, aligned scratch
stacks), so the first prefill with an adapter compiled new variants mid-serving. Padding the layer stride to a
multiple of 16 bytes makes every layer view as aligned as layer 0 (one variant for every layer); within a layer
the view keeps its contiguous strides, so the kernels see the same integer arguments on every layer.
"""
from __future__ import annotations

import math
from typing import Sequence, Union

import torch

ALIGN_BYTES = 16     # Triton's pointer specialization (`tt.divisibility` 16)


def layer_stride(per_layer_numel: int, dtype: torch.dtype) -> int:
    """Elements between two layers' views: the layer's elements rounded up to a multiple of 16 bytes."""
    step = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    return -(-per_layer_numel // step) * step


def layer_buffer(num_layers: int, shape: Sequence[int], dtype: torch.dtype, device: Union[torch.device, str],
                 fill: float = 0.0) -> torch.Tensor:
    """[num_layers, *shape] filled with `fill`, each layer view `t[i]` contiguous and 16-byte aligned (the
    allocation itself is: torch aligns every allocation to at least 64 bytes)."""
    per_layer = math.prod(shape)
    stride = layer_stride(per_layer, dtype)
    flat = torch.full((num_layers * stride,), fill, dtype=dtype, device=device)     # [L * stride]
    inner = torch.empty(tuple(shape), dtype=dtype, device="meta").stride()          # contiguous strides of a layer
    return flat.as_strided((num_layers, *shape), (stride, *inner))                 # [L, *shape]


def is_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGN_BYTES == 0
