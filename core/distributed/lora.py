"""LoRA under tensor parallelism (the S-LoRA / Punica layout).

- Column-parallel linears (qkv, gate_up): A whole, B by output rows; the delta lands on this rank's
  output columns with no communication.
- MoE experts (sharded by their intermediate dimension): gate/up B by output rows; down A by input columns with
  B whole, each rank's partial delta summed by the experts' own all-reduce (core/distributed/layers.py).
- Row-parallel linears (o, down): A by input columns; the partial shrink result h = x_local A_local^T
  ([S, T_lora, R], small) is all-reduced, then B (whole) is applied once to the replicated output. Decode
  batches with per-row slots (`DecodeLoRAMeta`, the CUDA-graph path) do the same with the BGMV halves.

`ShardedSlotPool` holds this rank's slices in the same slot layout as at N=1. On the driver of several ranks it
also journals every slot write and clear; the journal travels with the next step, and each worker applies
it to its own pool, so slots, hot loads and evictions are identical on every rank. At N=1 it is the plain
`LoRASlotPool` (whole adapters, no journal) and the wrappers are the plain ones.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from adapters.adapter import LoRAAdapter
from adapters.layers.dims import BaseModelDims
from adapters.layers.expert_lora import apply_expert_lora_wrappers
from adapters.layers.lora_linear import LoRALinear, apply_lora_wrappers, linear_parent
from adapters.lora_ops.bgmv import DecodeLoRAMeta
from adapters.lora_ops.bgmv_split import bgmv_expand, bgmv_shrink
from adapters.lora_ops.backends import LoRABackends
from adapters.lora_ops.dispatch import expand, shrink
from adapters.slots.slot_pool import LoRASlotPool
from core.distributed.parallel_state import TPGroup
from core.distributed.shard import TPShard

SlotOp = tuple[str, int, Any]   # ("write", slot, (source, path, modules, expert modules)) | ("clear", slot, None)


class ShardedSlotPool(LoRASlotPool):
    def __init__(self, num_slots: int, max_rank: int, shard: TPShard, device: torch.device,
                 dtype: torch.dtype, journal: bool, backends: LoRABackends) -> None:
        super().__init__(num_slots, max_rank, BaseModelDims.from_model_config(shard.local_config()),
                         device=device, dtype=dtype, backends=backends)
        self.shard = shard
        self._journal: list[SlotOp] | None = [] if journal else None

    def check_compatible(self, adapter: LoRAAdapter) -> None:
        super().check_compatible(self.shard.shard_adapter(adapter))

    def _write_slot(self, slot: int, adapter: LoRAAdapter, non_blocking: bool = False) -> None:
        super()._write_slot(slot, self.shard.shard_adapter(adapter), non_blocking)
        if self._journal is not None:
            self._journal.append(("write", slot, (adapter.source, adapter.path, dict(adapter.modules),
                                                  dict(adapter.expert_modules))))

    def _clear_slot(self, slot: int) -> None:
        super()._clear_slot(slot)
        if self._journal is not None:
            self._journal.append(("clear", slot, None))

    def take_journal(self) -> list[SlotOp]:
        ops = self._journal or []
        if self._journal is not None:
            self._journal = []
        return ops

    def apply_ops(self, ops: list[SlotOp]) -> None:
        """Worker side: replays the driver's slot writes and clears into this rank's buffers."""
        for kind, slot, payload in ops:
            if kind == "clear":
                super()._clear_slot(slot)
            else:
                source, path, modules, experts = payload
                self._write_slot(slot, LoRAAdapter(source=source, path=path, modules=modules, expert_modules=experts))


class RowParallelLoRALinear(LoRALinear):
    """base (all-reduced) + B(all_reduce(x_local A_local^T)) for the LoRA tokens of the step."""

    def __init__(self, wrapped: LoRALinear, tp: TPGroup) -> None:
        nn.Module.__init__(self)
        self.base, self.group, self.layer_idx = wrapped.base, wrapped.group, wrapped.layer_idx
        self.y_offset, self.context, self.stack = wrapped.y_offset, wrapped.context, wrapped.stack
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        meta = self.context.meta
        if meta is None or not meta.has_lora:
            return y
        x2 = x.reshape(-1, x.shape[-1])                               # [T, in / N]
        y2 = y.view(-1, y.shape[-1])                                  # [T, out]
        meta.check_num_tokens(x2.shape[0])
        backend = self.context.backends.for_meta(meta)
        if isinstance(meta, DecodeLoRAMeta):                          # padded decode batch (CUDA graphs)
            h = bgmv_shrink(x2, self.stack, meta, backend)            # partial sums, backend layout
            self.tp.all_reduce(h)
            bgmv_expand(y2, h, self.stack, meta, self.y_offset, backend)
            return y
        h = torch.zeros(self.stack.num_slices, meta.num_lora_tokens, self.stack.max_rank,
                        dtype=torch.float32, device=x2.device)        # [S, T_lora, R]
        shrink(x2, self.stack, meta, out=h, backend=backend)
        self.tp.all_reduce(h)
        expand(y2, h, self.stack, meta, self.y_offset, backend=backend)
        return y


def apply_tp_lora_wrappers(model: nn.Module, pool: ShardedSlotPool, tp: TPGroup) -> None:
    apply_lora_wrappers(model, pool)
    if pool.experts is not None:            # an MoE base: LoRA on its experts
        apply_expert_lora_wrappers(model, pool.experts, pool.context)
    if tp.world_size == 1:
        return
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallelLoRALinear(layer.self_attn.o_proj, tp)
        mlp = linear_parent(layer, "mlp")         # an MoE layer: its shared expert's, if it has one
        if mlp is not None:
            mlp.down_proj = RowParallelLoRALinear(mlp.down_proj, tp)
