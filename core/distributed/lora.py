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

DoRA: a column-parallel linear's rows are whole on a rank (its magnitudes are sharded with B's rows), so its
scales are computed locally; a row-parallel linear's rows span the ranks, so each rank computes its columns'
partial squared norms at the slot write and every rank all-reduces the step's pending partials in one collective
(`finish_dora`: the driver after sending the step, the workers after replaying its journal, both before the
forward), then rescales after the linear's all-reduce as at N=1. DoRA on the LM head (vocabulary rows sharded)
is refused at N > 1 (`tp_adapter_loader`, the registry's loader there).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from adapters.adapter import LoRAAdapter, LoRAModule
from adapters.errors import CODE_UNSUPPORTED_FEATURE, AdapterError
from adapters.layers.dims import MODULE_TO_GROUP, BaseModelDims
from adapters.layers.expert_lora import apply_expert_lora_wrappers
from adapters.layers.lora_linear import LoRALinear, apply_lora_wrappers, linear_parent
from adapters.lora_ops.bgmv import DecodeLoRAMeta
from adapters.lora_ops.bgmv_split import bgmv_expand, bgmv_shrink
from adapters.lora_ops.backends import LoRABackends
from adapters.lora_ops.dispatch import expand, shrink
from adapters.peft.loader import load_peft_adapter
from adapters.slots.dora_scales import dora_norm_sq, scale_shift
from adapters.slots.slot_pool import LoRASlotPool
from core.distributed.parallel_state import TPGroup
from core.distributed.shard import TPShard

# ("write", slot, (source, path, modules, expert modules, vocab modules)) | ("clear", slot, None)
SlotOp = tuple[str, int, Any]
ROW_PARALLEL = ("o_proj", "down_proj")
# a row-parallel DoRA module waiting for its norms' all-reduce: (slot, layer, name, partial squares, module, bias)
PendingNorm = tuple[int, int, str, torch.Tensor, LoRAModule, "torch.Tensor | None"]


def check_tp_adapter(adapter: LoRAAdapter) -> None:
    """What tensor parallelism cannot serve: DoRA on the LM head (its rows' norms span the vocabulary shards)."""
    mod = adapter.vocab_modules.get("lm_head")
    if mod is not None and mod.is_dora:
        raise AdapterError("DoRA on the LM head (lm_head) is not supported with tensor parallelism",
                           CODE_UNSUPPORTED_FEATURE)


def tp_adapter_loader(source: Any, dims: BaseModelDims, max_rank: int) -> LoRAAdapter:
    """The registry's loader at tensor_parallel_size > 1: PEFT's, then `check_tp_adapter` (a 400 at load)."""
    adapter = load_peft_adapter(source, dims, max_rank)
    check_tp_adapter(adapter)
    return adapter


class ShardedSlotPool(LoRASlotPool):
    def __init__(self, num_slots: int, max_rank: int, shard: TPShard, device: torch.device,
                 dtype: torch.dtype, journal: bool, backends: LoRABackends, tp: TPGroup | None = None) -> None:
        super().__init__(num_slots, max_rank, BaseModelDims.from_model_config(shard.local_config()),
                         device=device, dtype=dtype, backends=backends)
        self.shard, self.tp = shard, tp
        self._journal: list[SlotOp] | None = [] if journal else None
        self._pending_norms: list[PendingNorm] = []      # row-parallel DoRA norms of this step's slot writes
        self._writing: list[PendingNorm] = []            # those of the slot write in progress (slot not yet known)

    def check_compatible(self, adapter: LoRAAdapter) -> None:
        if self.shard.world_size > 1:
            check_tp_adapter(adapter)
        super().check_compatible(self.shard.shard_adapter(adapter))

    def _write_slot(self, slot: int, adapter: LoRAAdapter, non_blocking: bool = False) -> None:
        self._writing = []
        super()._write_slot(slot, self.shard.shard_adapter(adapter), non_blocking)
        self._pending_norms += [(slot, *rest) for _, *rest in self._writing]
        self._writing = []
        if self._journal is not None:
            self._journal.append(("write", slot, (adapter.source, adapter.path, dict(adapter.modules),
                                                  dict(adapter.expert_modules), dict(adapter.vocab_modules))))

    def _clear_slot(self, slot: int) -> None:
        super()._clear_slot(slot)
        self._pending_norms = [p for p in self._pending_norms if p[0] != slot]   # every rank clears the same
        if self._journal is not None:
            self._journal.append(("clear", slot, None))

    def _dora_module(self, layer: int, name: str, weight: torch.Tensor, bias: torch.Tensor | None,
                     module: LoRAModule) -> tuple[torch.Tensor, torch.Tensor]:
        if self.shard.world_size == 1 or name not in ROW_PARALLEL:
            return super()._dora_module(layer, name, weight, bias, module)
        self._writing.append((-1, layer, name, dora_norm_sq(weight, module), module, bias))
        ones = torch.ones(weight.shape[0], dtype=torch.float32, device=weight.device)
        return ones, torch.zeros_like(ones)             # identity until `finish_dora`

    def finish_dora(self) -> None:
        """All-reduces the row-parallel DoRA norms of the slot writes since the last call and writes their scales.
        Every rank calls it at the same point of every step (before the forward): it runs a collective exactly when
        the step's slot writes (identical on every rank) left norms pending."""
        pending, self._pending_norms = self._pending_norms, []
        if not pending or self.tp is None or self.shard.world_size == 1:
            return
        sq = torch.cat([p[3] for p in pending])                                   # [sum of out]
        self.tp.all_reduce(sq)
        offset = 0
        for slot, layer, name, part, module, bias in pending:
            norm = sq[offset:offset + part.numel()].sqrt()                         # [out]
            offset += part.numel()
            scale, shift = scale_shift(norm, module, bias)
            gname, s = MODULE_TO_GROUP[name]
            buf = self.groups[gname]
            off, size = buf.group.slice_offsets[s], buf.group.slice_sizes[s]
            buf.dora_scale[layer, slot, off:off + size].copy_(scale)
            buf.dora_shift[layer, slot, off:off + size].copy_(shift)

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
                source, path, modules, experts, vocab = payload
                self._write_slot(slot, LoRAAdapter(source=source, path=path, modules=modules, expert_modules=experts,
                                                   vocab_modules=vocab))


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
