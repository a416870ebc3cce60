"""Persistent LoRA metadata for CUDA-graph decode batches (the BGMV kernels of `bgmv.py`).

A captured graph replays fixed kernel grids, so the per-step adapter mix lives in device buffers that
are refilled before every replay: each row's slot (-1 = base; padded rows too), the rows sorted by
slot, and the rows grouped by slot (`bgmv.decode_groups`: the step's tokens grouped by adapter once, at most
BLOCK_M rows a group, read by every LoRA launch of the step). The BGMV grids span the padded batch size and the pool only, so one graph
per size serves any mix.

    bufs = GraphLoRABuffers(max_batch_size, num_slots, device[, group_rows])   # groups of <= group_rows rows
    meta = bufs.meta(B)                  # once per captured size (views of the persistent buffers)
    bufs.fill(token_slots, B)            # every step, before the replay: one pinned H2D copy
"""
from __future__ import annotations

import numpy as np
import torch

from adapters.lora_ops.bgmv import (
    BLOCK_M, GROUP_ROWS_OPTIONS, DecodeLoRAMeta, aligned_rows, decode_groups, max_groups,
)

NUM_FIELDS = 5          # row slots | row order | group slots | group starts | group rows, each `stride` long


class GraphLoRABuffers:
    def __init__(self, max_batch_size: int, num_slots: int, device: torch.device | str,
                 group_rows: int = BLOCK_M) -> None:
        assert group_rows in GROUP_ROWS_OPTIONS, f"group_rows {group_rows} not in {GROUP_ROWS_OPTIONS}"
        self.max_batch_size = max_batch_size
        self.num_slots = num_slots
        self.group_rows = group_rows     # the most rows of a group: the kernels' BLOCK_M (bgmv.GROUP_ROWS_OPTIONS)
        self.device = torch.device(device)
        # each field starts 16-byte aligned, as `DecodeLoRAMeta.build`'s (the warm-up's): the same kernel variants
        self.stride = b = aligned_rows(max_batch_size)
        self.dev = torch.full((NUM_FIELDS * b,), -1, dtype=torch.int32, device=self.device)   # [5 * stride] fields
        # two pinned staging buffers used in turn (async scheduling fills step t+1 while step t's copy may
        # still be queued)
        self.staging = [torch.zeros(NUM_FIELDS * b, dtype=torch.int32, pin_memory=self.device.type == "cuda")
                        for _ in range(2)]
        self.num_fills = 0
        self.copied: list[torch.cuda.Event | None] = [None, None]   # last copy out of each staging buffer
        self._metas: dict[int, DecodeLoRAMeta] = {}

    def _views(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = self.stride
        groups = self.dev[2 * b:].view(3, b)[:, :batch_size]                              # [3, batch_size]
        return self.dev[:batch_size], self.dev[b:b + batch_size], groups

    def meta(self, batch_size: int) -> DecodeLoRAMeta:
        """The metadata of a graph of `batch_size` rows (views of the persistent buffers)."""
        if batch_size not in self._metas:
            assert 0 < batch_size <= self.max_batch_size
            slots, order, groups = self._views(batch_size)
            self._metas[batch_size] = DecodeLoRAMeta(num_tokens=batch_size, row_slots=slots, row_order=order,
                                                     groups=groups, group_rows=self.group_rows)
        return self._metas[batch_size]

    def fill(self, token_slots: np.ndarray, batch_size: int) -> None:
        """Writes a step's per-row slots (its real rows; the padding gets -1) into the buffers of `batch_size`."""
        n = len(token_slots)
        assert n <= batch_size <= self.max_batch_size
        slots = np.full(batch_size, -1, dtype=np.int64)
        slots[:n] = token_slots
        assert (slots < self.num_slots).all(), "slot index out of the pool"
        turn = self.num_fills % 2
        staging = self.staging[turn]
        self.num_fills += 1
        if self.copied[turn] is not None:
            self.copied[turn].synchronize()   # its last copy is done
        h = staging.numpy()
        b = self.stride
        order, groups = decode_groups(slots, self.group_rows)
        h[:batch_size] = slots
        h[b:b + batch_size] = order
        h[2 * b:].reshape(3, b)[:, :batch_size] = groups                               # [3, batch_size]
        self.dev.copy_(staging, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            self.copied[turn] = torch.cuda.Event()
            self.copied[turn].record(torch.cuda.current_stream(self.device))

    def check_integrity(self, batch_size: int) -> None:
        """The order is a permutation of the rows, sorted by slot with base rows last; the groups cover the LoRA
        rows of the order exactly, in order: each slot's rows in consecutive groups of `group_rows` rows but its
        last, no group past the kernels' grid (`max_groups`), the unused ones empty."""
        slots, order, groups = (t.cpu().numpy() for t in self._views(batch_size))
        assert sorted(order.tolist()) == list(range(batch_size))
        key = np.where(slots[order] >= 0, slots[order], self.num_slots)
        assert (np.diff(key) >= 0).all() and (slots < self.num_slots).all() and (slots >= -1).all()
        n = int((groups[2] > 0).sum())
        rows = self.group_rows
        assert n <= max_groups(batch_size, self.num_slots, rows), "more groups than the kernels' grid"
        assert (groups[2, n:] == 0).all() and (groups[2, :n] <= rows).all()
        assert (groups[1, :n] == np.cumsum(groups[2, :n]) - groups[2, :n]).all(), "groups not back to back"
        for i, (g_slot, start, size) in enumerate(groups[:, :n].T):
            assert (slots[order[start:start + size]] == g_slot).all()
            last_of_slot = i + 1 == n or groups[0, i + 1] != g_slot
            assert last_of_slot or size == rows, "a slot's group short of group_rows before its last"
        assert groups[2, :n].sum() == (slots >= 0).sum()
        assert len(np.unique(groups[0, :n])) == len(np.unique(slots[slots >= 0]))
