"""LoRA wrappers for the base model's fused linears; the model code stays free of LoRA.

    pool = LoRASlotPool(max_loras, max_lora_rank, dims, device, dtype)
    apply_lora_wrappers(model, pool)        # once, after the base weights are loaded
    pool.context.set_batch(token_slots)     # every step, before the forward
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from adapters.layers.dims import GROUP_ATTRS
from adapters.layers.vocab_lora import apply_vocab_lora_wrappers, remove_vocab_lora_wrappers
from adapters.lora_ops import add_lora
from adapters.lora_ops.bgmv import DecodeLoRAMeta
from adapters.lora_ops.bgmv_overlap import delta_buffer, triton_bgmv_add_delta, triton_bgmv_delta
from adapters.slots.slot_pool import LoRASlotPool

SliceSpec = tuple[str, int, int]  # (HF module name, output column offset, output size)


class LoRALinear(nn.Module):
    """base(x) plus, for every LoRA token of the step, the LoRA delta of each output slice; tokens of a DoRA slot
    then get their rows rescaled (inside `add_lora`)."""

    def __init__(self, base: nn.Module, slices: Sequence[SliceSpec], pool: LoRASlotPool,
                 layer_idx: int) -> None:
        super().__init__()
        names = tuple(name for name, _, _ in slices)
        group = next((g for g, buf in pool.groups.items() if buf.group.slices == names), None)
        if group is None:
            raise ValueError(f"no LoRA group for slices {names}")
        grp = pool.groups[group].group
        y_offset = slices[0][1]
        if [(o - y_offset, n) for _, o, n in slices] != list(zip(grp.slice_offsets, grp.slice_sizes)):
            raise ValueError(f"slices {list(slices)} do not match the pool layout {grp.slice_spec()}")
        if base.in_features != grp.in_features or base.out_features < y_offset + grp.out_features:
            raise ValueError(f"linear {base.in_features}->{base.out_features} does not fit LoRA "
                             f"group {group} ({grp.in_features}->{grp.out_features})")
        self.base = base
        self.group = group
        self.layer_idx = layer_idx
        self.y_offset = y_offset
        self.context = pool.context
        self.stack = pool.stack(layer_idx, group)
        pool.register_base(layer_idx, group, base, y_offset)   # DoRA's norms read the base weight

    @property
    def weight(self) -> torch.Tensor | None:
        return getattr(self.base, "weight", None)   # None over a quantized base (no float weight in memory)

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        meta = self.context.meta
        if meta is None or not meta.has_lora:
            return self.base(x)  # base-only step: no extra work
        backends = self.context.backends
        if backends.overlaps(meta):
            return self._forward_beside(x, meta)
        y = self.base(x)
        x2 = x.reshape(-1, x.shape[-1])  # [T, in]
        y2 = y.view(-1, y.shape[-1])  # [T, out]
        add_lora(y2, x2, self.stack, meta, self.y_offset, backend=backends.for_meta(meta))
        return y

    def _forward_beside(self, x: torch.Tensor, meta: DecodeLoRAMeta) -> torch.Tensor:
        """The LoRA delta on the side stream while the base GEMM runs, then added (bgmv_overlap.py). Every tensor the
        side stream touches is made on the main stream, or on the side stream and dropped there; the main stream
        waits for the side stream before it reads the delta or frees x (both after the join, in this call)."""
        x2 = x.reshape(-1, x.shape[-1])  # [T, in]
        meta.check_num_tokens(x2.shape[0])
        delta = delta_buffer(self.stack, meta, x.device)   # [T, N] float32, the main stream's
        side = self.context.side_stream()
        if side is None:                       # no CUDA (Triton's interpreter): the same ops in turn
            triton_bgmv_delta(x2, self.stack, meta, delta)
            y = self.base(x)
        else:
            main = torch.cuda.current_stream(x.device)
            side.wait_stream(main)             # x, the step's metadata, the slots and the buffer are ready
            with torch.cuda.stream(side):
                triton_bgmv_delta(x2, self.stack, meta, delta)   # its h: made and dropped on the side stream
            y = self.base(x)
            main.wait_stream(side)
        triton_bgmv_add_delta(y.view(-1, y.shape[-1]), delta, self.stack, meta, self.y_offset)   # [T, out]
        return y

    def extra_repr(self) -> str:
        return f"group={self.group}, layer={self.layer_idx}, y_offset={self.y_offset}"


def is_linear(module: nn.Module) -> bool:
    """nn.Linear, or a layer standing for one (a quantized base: core.quant.linear.QuantLinear) that has
    `in_features`, `out_features` and `bias`; LoRA adds to its (dequantized) output the same way."""
    return isinstance(module, nn.Linear) or (isinstance(getattr(module, "in_features", None), int)
                                             and isinstance(getattr(module, "out_features", None), int)
                                             and hasattr(module, "bias"))


def _decoder_layers(model: nn.Module) -> Sequence[nn.Module]:
    for owner in (model, getattr(model, "model", None)):
        layers = getattr(owner, "layers", None) if owner is not None else None
        if layers is not None:
            return layers
    raise ValueError("model has no `layers` (nor `model.layers`) to wrap")


def linear_parent(layer: nn.Module, parent_name: str) -> nn.Module | None:
    """The module holding a layer's `parent_name` linears: an MoE block's (core/models/moe.py) dense linears are
    its shared expert's (Qwen2-MoE); a block without one has none (its experts: adapters/layers/expert_lora.py)."""
    parent = getattr(layer, parent_name)
    if parent_name == "mlp" and hasattr(parent, "experts"):
        return getattr(parent, "shared_expert", None)
    return parent


def apply_lora_wrappers(model: nn.Module, pool: LoRASlotPool) -> None:
    """Swap qkv_proj, o_proj, gate_up_proj and down_proj of every layer for LoRALinear, and the embedding and LM
    head (when the model has them) for their LoRA wrappers (`vocab_lora.py`).
    Idempotent: already wrapped linears are left alone."""
    layers = _decoder_layers(model)
    if len(layers) != pool.dims.num_layers:
        raise ValueError(f"model has {len(layers)} layers, the pool {pool.dims.num_layers}")
    for idx, layer in enumerate(layers):
        for group, (parent_name, attr) in GROUP_ATTRS.items():
            parent = linear_parent(layer, parent_name)
            if parent is None:
                continue
            module = getattr(parent, attr)
            if isinstance(module, LoRALinear):
                continue
            if not is_linear(module):
                raise TypeError(f"layers[{idx}].{parent_name}.{attr} is {type(module).__name__}, "
                                "expected a linear layer")
            spec = pool.groups[group].group.slice_spec()
            setattr(parent, attr, LoRALinear(module, spec, pool, idx))
    apply_vocab_lora_wrappers(model, pool)


def remove_lora_wrappers(model: nn.Module) -> None:
    """Put the plain base linears (and embedding and LM head) back."""
    remove_vocab_lora_wrappers(model)
    for layer in _decoder_layers(model):
        for parent_name, attr in GROUP_ATTRS.values():
            parent = linear_parent(layer, parent_name)
            if parent is None:
                continue
            module = getattr(parent, attr)
            if isinstance(module, LoRALinear):
                setattr(parent, attr, module.base)
