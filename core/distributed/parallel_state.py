"""Process groups of one tensor-parallel engine and the collectives the parallel layers use.

Two groups over the same ranks:
- `device_group` (NCCL on CUDA, gloo on CPU): activations (all-reduce after row-parallel layers, the
  LoRA shrink result, the vocabulary-parallel embedding; the logits gather). Its timeout is the step
  timeout, so a hung rank turns into an error on the others instead of a hang.
- `cpu_group` (gloo, no practical timeout): the driver's per-step messages; a worker may wait in it for
  as long as the server is idle.

A single rank (`TPGroup.single()`) has no process group: every collective returns its input at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from core.environment.variables import TP_STEP_TIMEOUT_S

IDLE_TIMEOUT = timedelta(days=3650)


def step_timeout_s() -> float:
    """Seconds one collective may wait for the other ranks (LORAPLEX_TP_STEP_TIMEOUT_S, default 120)."""
    return TP_STEP_TIMEOUT_S.get()


@dataclass(frozen=True)
class TPGroup:
    rank: int
    world_size: int
    device_group: Any
    cpu_group: Any

    @staticmethod
    def single() -> "TPGroup":
        """The group of a single-rank engine: no process group, no communication."""
        return TPGroup(rank=0, world_size=1, device_group=None, cpu_group=None)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns `t`."""
        if self.world_size > 1:
            dist.all_reduce(t, group=self.device_group)
        return t

    def gather_to_driver(self, t: torch.Tensor) -> torch.Tensor | None:
        """Concatenates every rank's `t` along the last dim on rank 0 (None elsewhere)."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            dist.gather(t, gather_list=parts, dst=0, group=self.device_group)
            return torch.cat(parts, dim=-1)
        dist.gather(t, gather_list=None, dst=0, group=self.device_group)
        return None

    def broadcast_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` into every rank's `t` (same shape and dtype), on the device group; returns `t`."""
        if self.world_size > 1:
            dist.broadcast(t, src=0, group=self.device_group)
        return t

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends `obj` to every rank; the others receive it (blocks while the driver is idle)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def min_int(self, value: int) -> int:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


def init_tp_group(rank: int, world_size: int, init_method: str, device: torch.device) -> TPGroup:
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process: one tensor-parallel "
                           "engine per process (shut the previous one down first)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=step_timeout_s()))
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TPGroup(rank=rank, world_size=world_size, device_group=dist.group.WORLD, cpu_group=cpu_group)


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
