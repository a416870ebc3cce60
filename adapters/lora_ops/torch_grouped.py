"""The torch path of `add_lora` for grouped (prefill and mixed) metadata: the CPU's multi-LoRA at its FLOP floor.

Batched (the step's `LoRABatchMeta.padded` layout): x is gathered once per linear into [E, width, in] rows, one
slot per entry, and every slice costs two `bmm`s over all entries at once, at the real rank of the step's
adapters (groups of different ranks take one pair of `bmm`s per rank: mixed ranks cost the sum of their ranks,
never the pool's max rank). A and B are read through views of the slot stacks when the entries are a range
of slots (no copy of adapter weights). The deltas of every slice are added to the output rows with one
scatter.
Runs (prefill chunks: at least `MIN_RUN_TOKENS` consecutive tokens of one slot): matmuls on the run's slices
of x and y, the expand accumulating into y itself (`addmm_`): no gather, scatter or delta buffer.
Segmented (the tokens outside runs, when padding them would cost too much): a loop over their groups.
Stacked (on the CPU, a decode batch of at most `STACKED_MAX_ADAPTERS` adapters and `STACKED_MAX_ROWS` rows, first):
the step's adapters' fused pairs side by side, every row against all of them with the other adapters' columns
zeroed (`cpu_stacked`): two matmuls and a fill per linear whatever the number of adapters.
Fused (on the CPU, when it takes fewer ops than batched, and always instead of segmented): two matmuls per adapter
against its slot's weights with every slice fused (`LoRAStack.fused_slot`), where an op's dispatch costs more than
its FLOPs (decode rows of a few adapters).

On the CPU a run, or a group of the fused path, whose size pays for it (`cpu_packed.use_packed`: a rank-32
adapter's prefill chunk, not one decode row) multiplies by the slot's fused pair packed once for oneDNN
(`LoRAStack.packed_slot`) instead of `torch.mm`: MKL re-blocks the weight on every call (1.3-2.8x on LoRA's shapes).
Both compute in `compute_dtype` (fp32 on the CPU) and round into y once, as `torch_shrink` / `torch_expand`.
"""
from __future__ import annotations

from typing import Optional

import torch

from adapters.lora_ops.cpu_packed import use_packed
from adapters.lora_ops import cpu_stacked
from adapters.lora_ops.cpu_stacked import STACKED_MAX_ADAPTERS, STACKED_MAX_ROWS
from adapters.lora_ops.metadata import LoRABatchMeta, PaddedGroups
from adapters.lora_ops.stack import LoRAStack
from adapters.lora_ops.torch_ops import compute_dtype


def torch_add_lora_grouped(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, meta: LoRABatchMeta,
                           y_offset: int = 0) -> None:
    """y[token_ids[p], y_offset + off_s + n] += scale * (x[token_ids[p]] @ A_s^T) @ B_s^T of each token's slot:
    long runs on slices, the other tokens batched (`meta.torch_split`)."""
    split = meta.torch_split
    if split.runs:
        torch_add_lora_runs(y, x, stack, split.runs, y_offset)
    rest = split.rest
    if rest is None:
        return
    if x.device.type == "cpu" and stacked_pays(rest) and torch_add_lora_stacked(y, x, stack, rest, y_offset):
        return
    plan = rest.padded
    if x.device.type == "cpu" and (plan is None or fused_pays(stack, rest)):
        torch_add_lora_fused(y, x, stack, rest, y_offset)
    elif plan is None:
        torch_add_lora_segmented(y, x, stack, rest, y_offset)
    else:
        torch_add_lora_padded(y, x, stack, rest, plan, y_offset)


def fused_pays(stack: LoRAStack, meta: LoRABatchMeta) -> bool:
    """Whether the per-adapter fused matmuls (two per group) take fewer ops than the batched ones (per slice, at
    least about six: the weights' views or gathers, two `bmm`s, the scaling and the delta's columns): a step of a
    few adapters, or of adapters on a linear of several slices (measured on latency_slo.py's model, decode steps of
    8 rows over 3 adapters of ranks 8/16/32: 36 ms a step batched, the base model's 15 ms plus 7 ms an adapter;
    23 ms fused)."""
    return meta.num_groups <= 3 * stack.num_slices


def stacked_pays(meta: LoRABatchMeta) -> bool:
    """Whether the step's LoRA tokens take the stacked pair (`cpu_stacked`): a decode batch of a few adapters,
    where every row's product with the other adapters' columns costs less than the calls it saves."""
    return meta.num_groups <= STACKED_MAX_ADAPTERS and meta.num_lora_tokens <= STACKED_MAX_ROWS


def torch_add_lora_stacked(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, meta: LoRABatchMeta,
                           y_offset: int = 0) -> bool:
    """Every LoRA token against the step's adapters stacked (`LoRAStack.stacked_slots`; with few adapters in the
    pool, all of them: `LoRAStack.stacking_slots`), the other adapters' columns zeroed, added to its row: on the
    flat batch's rows when LoRA tokens are at least half of them (into y's columns, no gather or scatter; the base
    rows' products are zeroed too), else on the gathered LoRA rows.
    False (nothing done) when the rows times the stacked weights exceed `STACKED_MAX_WORK`, or the stacked pair is
    refused (a non-finite B): the caller takes another path."""
    cdt = compute_dtype(x)
    all_rows = 2 * meta.num_lora_tokens >= meta.num_tokens
    num_rows = meta.num_tokens if all_rows else meta.num_lora_tokens
    own = meta.group_slots_host
    stacked = None
    pool = stack.stacking_slots(own, cdt)   # the pool's every adapter when few: one pair for every mix of them
    if pool != own:
        stacked = stack.stacked_slots(pool, cdt)
        if stacked is not None and num_rows * stacked.num_weights > cpu_stacked.STACKED_MAX_WORK:
            stacked = None              # the other adapters' columns cost more than a pair of the step's own
    if stacked is None:
        stacked = stack.stacked_slots(own, cdt)
    if stacked is None:
        return not any(stack.fused_slot(slot, cdt) for slot in own)   # no rank: nothing to add
    if num_rows * stacked.num_weights > cpu_stacked.STACKED_MAX_WORK:
        return False                    # every row against every adapter costs more than the calls it saves
    xs = x.to(cdt) if all_rows else x.index_select(0, meta.token_rows).to(cdt)          # [rows, in]
    h = stacked.products(xs, meta.other_slot_mask(stacked.layout, all_rows))   # [rows, C]
    if not all_rows:
        _scatter_add(y, meta.token_rows, stacked.expand(h), y_offset)
        return True
    cols = y[:, y_offset:y_offset + stacked.num_cols]                                   # [T, N] view
    if cols.dtype != cdt:
        cols.copy_(cols.to(cdt) + stacked.expand(h))                                    # round once
    elif stacked.uses_packed(h):
        cols += stacked.expand(h)
    else:
        cols.addmm_(h, stacked.b.t())
    return True


def torch_add_lora_fused(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, meta: LoRABatchMeta,
                         y_offset: int = 0) -> None:
    """Every group's tokens times its slot's fused weights (`LoRAStack.fused_slot`: all slices in one A and one
    scaled B): the LoRA rows gathered once, two matmuls per adapter into one delta buffer, one scatter."""
    cdt = compute_dtype(x)
    num_cols = stack.lora_b.shape[1]
    weights = [stack.fused_slot(slot, cdt) for slot in meta.group_slots_host]
    if not any(weights):
        return
    rows = meta.token_rows                                                      # [T_lora] int64
    xg = x.index_select(0, rows).to(cdt)                                        # [T_lora, in], grouped by slot
    alloc = torch.empty if all(weights) else torch.zeros                        # every row written, else zeros
    delta = alloc(meta.num_lora_tokens, num_cols, dtype=cdt, device=x.device)   # [T_lora, N]
    for slot, fused, start, size in zip(meta.group_slots_host, weights, meta.group_starts_host,
                                        meta.group_sizes_host):
        if fused is None:
            continue
        a, b = fused
        if use_packed(x, size, a.numel() + b.numel()):   # oneDNN over the slot's packed pair (lora_ops/cpu_packed)
            packed = stack.packed_slot(slot, cdt)
            assert packed is not None
            delta[start:start + size] = packed.apply(xg[start:start + size])                   # [n, N]
        else:
            torch.mm(torch.mm(xg[start:start + size], a.t()), b.t(), out=delta[start:start + size])   # [n, N]
    _scatter_add(y, rows, delta, y_offset)


def torch_add_lora_runs(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, runs: tuple[tuple[int, int, int], ...],
                        y_offset: int = 0) -> None:
    """Each run (first row, rows, slot) of consecutive tokens of one slot: its rows of x times A at the slot's rank,
    scaled, times B, added into its rows and columns of y by the matmul itself (no gather, no scatter, no buffer)."""
    cdt = compute_dtype(x)
    ranks = stack.host_ranks()
    scalings = stack.host_scalings()
    num_cols = stack.lora_b.shape[1]
    for first, size, slot in runs:
        xs = x[first:first + size].to(cdt)                                         # [n, in]
        fused = stack.fused_slot(slot, cdt)
        if fused is None:
            continue
        if use_packed(x, size, fused[0].numel() + fused[1].numel()):   # oneDNN, every slice at once
            packed = stack.packed_slot(slot, cdt)
            assert packed is not None
            cols = y[first:first + size, y_offset:y_offset + num_cols]
            delta = packed.apply(xs)                                               # [n, N]
            if cols.dtype == cdt:
                cols += delta
            else:
                cols.copy_(cols.to(cdt) + delta)                                   # round once
            continue
        for s in range(stack.num_slices):
            r = ranks[s][slot]
            if r == 0:
                continue
            off, n_out = stack.slice_offsets[s], stack.slice_sizes[s]
            h = xs @ stack.lora_a[s, slot, :r].to(cdt).t()                         # [n, r]
            h *= scalings[s][slot]
            b = stack.lora_b[slot, off:off + n_out, :r].to(cdt)                    # [out_s, r]
            cols = y[first:first + size, y_offset + off:y_offset + off + n_out]
            if cols.dtype == cdt:
                cols.addmm_(h, b.t())
            else:
                cols.copy_(torch.addmm(cols.to(cdt), h, b.t()))                    # round once


def _rank_buckets(ranks: list[int], meta: LoRABatchMeta) -> dict[int, list[int]]:
    """{rank: the groups of that rank} over the groups of one slice; rank-0 groups get no LoRA."""
    buckets: dict[int, list[int]] = {}
    for g, slot in enumerate(meta.group_slots_host):
        if ranks[slot]:
            buckets.setdefault(ranks[slot], []).append(g)
    return buckets


def _entry_weights(stack: LoRAStack, plan: PaddedGroups, s: int, r: int,
                   entries: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A [E', r, in], B [E', out_s, r], scaling [E']) of slice s at rank r for all entries (entries None) or
    the given ones: views of the stacks when the entries are a slot range, else gathered rows (the first r)."""
    off, n_out = stack.slice_offsets[s], stack.slice_sizes[s]
    if entries is None and plan.slot_lo is not None:
        lo, hi = plan.slot_lo, plan.slot_lo + plan.num_entries
        return (stack.lora_a[s, lo:hi, :r], stack.lora_b[lo:hi, off:off + n_out, :r],   # views
                stack.scalings[s, lo:hi])
    slots = plan.entry_slots if entries is None else plan.entry_slots.index_select(0, entries)   # [E']
    return (stack.lora_a[s, :, :r].index_select(0, slots),                         # [E', r, in]
            stack.lora_b[:, off:off + n_out, :r].index_select(0, slots),           # [E', out_s, r]
            stack.scalings[s].index_select(0, slots))                              # [E']


def torch_add_lora_padded(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, meta: LoRABatchMeta,
                          plan: PaddedGroups, y_offset: int = 0) -> None:
    cdt = compute_dtype(x)
    num_entries, width = plan.num_entries, plan.width
    num_cols = stack.lora_b.shape[1]
    ranks = stack.host_ranks()                                                     # [S][slots]
    buckets = [_rank_buckets(ranks[s], meta) for s in range(stack.num_slices)]
    if not any(buckets):
        return                                  # no group targets this linear
    xp = x.index_select(0, plan.src_rows).to(cdt).view(num_entries, width, -1)   # [E, width, in]
    whole = all(len(b) == 1 and len(next(iter(b.values()))) == meta.num_groups for b in buckets)
    # every slice of every group in one bucket: each slice's columns are written whole, else zeros first
    delta: Optional[torch.Tensor] = None
    if not (whole and stack.num_slices == 1 and stack.slice_sizes[0] == num_cols):
        alloc = torch.empty if whole else torch.zeros
        delta = alloc(num_entries, width, num_cols, dtype=cdt, device=x.device)    # [E, width, N]
    for s, by_rank in enumerate(buckets):
        off, n_out = stack.slice_offsets[s], stack.slice_sizes[s]
        for r, groups in by_rank.items():
            entries = None if len(groups) == meta.num_groups else torch.tensor(
                [plan.group_entries[g] for g in groups], dtype=torch.int64, device=x.device)   # [E']
            a, b, scale = _entry_weights(stack, plan, s, r, entries)
            xs = xp if entries is None else xp.index_select(0, entries)           # [E', width, in]
            h = torch.bmm(xs, a.to(cdt).transpose(1, 2))                           # [E', width, r]
            d = torch.bmm(h, b.to(cdt).transpose(1, 2))                            # [E', width, out_s]
            d *= scale.to(cdt).view(-1, 1, 1)
            if delta is None:
                delta = d                       # one slice covering every column: no copy
            elif entries is None:
                delta[:, :, off:off + n_out] = d
            else:
                delta[entries, :, off:off + n_out] = d
    assert delta is not None
    rows = delta.view(num_entries * width, num_cols)                               # [E * width, N]
    if plan.valid_positions is not None:
        rows = rows.index_select(0, plan.valid_positions)                          # [T_lora, N]
    _scatter_add(y, plan.token_rows, rows, y_offset)


def _scatter_add(y: torch.Tensor, idx: torch.Tensor, delta: torch.Tensor, y_offset: int) -> None:
    """y[idx, y_offset : y_offset + N] += delta [len(idx), N], rounded into y's dtype once."""
    num_cols = delta.shape[1]
    if y.dtype == delta.dtype and y_offset == 0 and num_cols == y.shape[1]:
        y.index_add_(0, idx, delta)             # whole rows: no gather of y
        return
    rows = y.index_select(0, idx)               # [n, out_total] (index ops on column-slice views are slow on CPU)
    cols = rows[:, y_offset:y_offset + num_cols]
    cols.copy_(cols.to(delta.dtype) + delta)
    y.index_copy_(0, idx, rows)


def torch_add_lora_segmented(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, meta: LoRABatchMeta,
                             y_offset: int = 0) -> None:
    """A loop over the step's groups, each at its slot's real rank; a contiguous group reads and writes slices."""
    cdt = compute_dtype(x)
    ranks = stack.host_ranks()
    scalings = stack.host_scalings()
    num_cols = stack.lora_b.shape[1]
    groups = zip(meta.group_slots_host, meta.group_starts_host, meta.group_sizes_host, meta.group_first_token,
                 meta.group_contiguous)
    for slot, start, size, first, contiguous in groups:
        idx = None if contiguous else meta.token_ids[start:start + size].long()   # [n]
        xs = (x[first:first + size] if idx is None else x.index_select(0, idx)).to(cdt)   # [n, in]
        delta: Optional[torch.Tensor] = None
        for s in range(stack.num_slices):
            r = ranks[s][slot]
            if r == 0:
                continue
            off, n_out = stack.slice_offsets[s], stack.slice_sizes[s]
            h = xs @ stack.lora_a[s, slot, :r].to(cdt).t()                         # [n, r]
            d = h @ stack.lora_b[slot, off:off + n_out, :r].to(cdt).t()            # [n, out_s]
            d *= scalings[s][slot]
            if idx is None:
                cols = y[first:first + size, y_offset + off:y_offset + off + n_out]
                if cols.dtype == cdt:
                    cols += d
                else:
                    cols.copy_(cols.to(cdt) + d)                                   # round once
                continue
            if delta is None:
                delta = torch.zeros(size, num_cols, dtype=cdt, device=x.device)    # [n, N]
            delta[:, off:off + n_out] = d
        if delta is not None:
            _scatter_add(y, idx, delta, y_offset)
