"""Pinned host staging for a graph runner's persistent device buffers: two sets, used in turn.

A graph replays over fixed device buffers, so each step's inputs are written on the host into a pinned staging
set and reach the device with one non-blocking copy per buffer. With async scheduling step t+1 is filled while
step t's copy may still be queued, so there are two sets: before a set is reused, its previous copy (two steps
back, whose tokens were read since) is waited for.

    staging = Staging([torch.int64, torch.int32], [n64, n32], device)
    h64, h32 = staging.next()        # numpy views of the set to fill
    ...                              # write the step's inputs
    staging.copy_to([dev64, dev32], [n64, count32])
"""
from __future__ import annotations

import numpy as np
import torch


class Staging:
    def __init__(self, dtypes: list[torch.dtype], lengths: list[int], device: torch.device) -> None:
        self.device = device
        pin = device.type == "cuda"
        self.sets = [[torch.zeros(n, dtype=d, pin_memory=pin) for d, n in zip(dtypes, lengths)] for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]   # last copy out of each set
        self.num_fills = 0
        self.turn = 0

    def next(self) -> list[np.ndarray]:
        """The set to fill now (numpy views), once its last copy has left."""
        self.turn = self.num_fills % 2
        self.num_fills += 1
        if self.copied[self.turn] is not None:
            self.copied[self.turn].synchronize()   # already done when every step's tokens are read
        return [t.numpy() for t in self.sets[self.turn]]

    def copy_to(self, targets: list[torch.Tensor], counts: list[int]) -> None:
        """Copies the first `counts[i]` elements of the set just filled into `targets[i]` (non-blocking on CUDA)."""
        non_blocking = self.device.type == "cuda"
        for host, dev, n in zip(self.sets[self.turn], targets, counts):
            dev[:n].copy_(host[:n], non_blocking=non_blocking)
        if non_blocking:
            self.copied[self.turn] = torch.cuda.Event()
            self.copied[self.turn].record(torch.cuda.current_stream(self.device))
