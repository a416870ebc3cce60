"""Persistent LoRA metadata for CUDA-graph decode batches.

A captured graph replays fixed kernel grids, so the per-step grouping (tokens sorted by slot)
cannot change the grid. Here the LoRA tokens of a padded batch of B rows are grouped by slot and
cut into tiles of at most `TILE` tokens; the Triton shrink/expand kernels treat every tile as a
group. A batch of B tokens over at most G = min(num_slots, B) slots needs at most
`floor((B + G * (TILE - 1)) / TILE)` tiles (and never more than B), so a graph's grid covers that
many; tiles past the step's count have size 0 and their programs exit at once.

    bufs = GraphLoRABuffers(max_batch_size, num_slots, device)
    meta = bufs.meta(B)                  # once per captured size (views of the persistent buffers)
    bufs.fill(token_slots, B)            # every step, before the replay: one pinned H2D copy
"""
from __future__ import annotations

import numpy as np
import torch

from adapters.lora_ops.metadata import LoRABatchMeta

TILE = 16


class GraphLoRABuffers:
    def __init__(self, max_batch_size: int, num_slots: int, device: torch.device) -> None:
        self.max_batch_size = max_batch_size
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.max_tiles = self.num_tiles(max_batch_size)
        size = max_batch_size + 3 * self.max_tiles   # token_ids | tile slots | tile starts | tile sizes
        self.dev = torch.zeros(size, dtype=torch.int32, device=self.device)
        # two pinned staging buffers used in turn (async scheduling fills step t+1 while step t's copy may
        # still be queued)
        self.staging = [torch.zeros(size, dtype=torch.int32, pin_memory=self.device.type == "cuda")
                        for _ in range(2)]
        self.num_fills = 0
        self.copied: list[torch.cuda.Event | None] = [None, None]   # last copy out of each staging buffer
        self._metas: dict[int, LoRABatchMeta] = {}

    def num_tiles(self, batch_size: int) -> int:
        """Upper bound on the tiles of a batch of `batch_size` LoRA tokens."""
        groups = min(self.num_slots, batch_size)
        return max(1, min(batch_size, (batch_size + groups * (TILE - 1)) // TILE))

    def _views(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        b, m, n = self.max_batch_size, self.max_tiles, self.num_tiles(batch_size)
        d = self.dev
        return d[:batch_size], d[b:b + n], d[b + m:b + m + n], d[b + 2 * m:b + 2 * m + n]

    def meta(self, batch_size: int) -> LoRABatchMeta:
        """The padded metadata of a graph of `batch_size` rows (views of the persistent buffers)."""
        if batch_size not in self._metas:
            assert 0 < batch_size <= self.max_batch_size
            token_ids, slots, starts, sizes = self._views(batch_size)
            self._metas[batch_size] = LoRABatchMeta(
                num_tokens=batch_size, num_lora_tokens=batch_size, max_group_size=TILE, token_ids=token_ids,
                group_slots=slots, group_starts=starts, group_sizes=sizes, group_slots_host=(),
                group_starts_host=(), group_sizes_host=(), group_first_token=(), group_contiguous=(),
                padded=True)
        return self._metas[batch_size]

    def tiles(self, token_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(token ids grouped by slot, tile slots, tile starts, tile sizes) of per-token slots (-1 = base)."""
        pos = np.nonzero(token_slots >= 0)[0]
        order = np.argsort(token_slots[pos], kind="stable")
        token_ids = pos[order]                                              # [T_lora]
        slots, starts, counts = np.unique(token_slots[token_ids], return_index=True, return_counts=True)
        per_group = -(-counts // TILE)                                      # tiles per slot group
        tile_group = np.repeat(np.arange(len(slots)), per_group)            # [num_tiles]
        first_tile = np.cumsum(per_group) - per_group
        local = np.arange(len(tile_group)) - first_tile[tile_group]         # tile index inside its group
        tile_starts = starts[tile_group] + local * TILE
        tile_sizes = np.minimum(TILE, counts[tile_group] - local * TILE)
        return token_ids, slots[tile_group], tile_starts, tile_sizes

    def fill(self, token_slots: np.ndarray, batch_size: int) -> None:
        """Writes a step's grouping (per-token slots of its real rows) into the buffers of size `batch_size`."""
        assert len(token_slots) <= batch_size <= self.max_batch_size
        token_ids, slots, starts, sizes = self.tiles(np.asarray(token_slots, dtype=np.int64))
        b, m, n = self.max_batch_size, self.max_tiles, self.num_tiles(batch_size)
        assert len(slots) <= n, "more tiles than the graph's grid covers"
        turn = self.num_fills % 2
        staging = self.staging[turn]
        self.num_fills += 1
        if self.copied[turn] is not None:
            self.copied[turn].synchronize()   # its last copy is done
        h = staging.numpy()
        h[:len(token_ids)] = token_ids
        for i, arr in enumerate((slots, starts, sizes)):
            off = b + i * m
            h[off:off + len(arr)] = arr
            h[off + len(arr):off + n] = 0
        self.dev.copy_(staging, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            self.copied[turn] = torch.cuda.Event()
            self.copied[turn].record(torch.cuda.current_stream(self.device))

    def check_integrity(self, batch_size: int) -> None:
        """Tiles cover every LoRA token once, each tile within one slot and at most TILE tokens."""
        token_ids, slots, starts, sizes = (t.cpu().numpy() for t in self._views(batch_size))
        used = sizes > 0
        assert (sizes[used] <= TILE).all() and (sizes[~used] == 0).all()
        covered = np.concatenate([token_ids[s:s + n] for s, n in zip(starts[used], sizes[used])] or [np.zeros(0)])
        assert len(np.unique(covered)) == len(covered) and (slots[used] < self.num_slots).all()
