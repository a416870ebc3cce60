"""Stacked LoRA weights of one (possibly fused) linear, as the shrink/expand ops take them.

A fused linear (qkv, gate_up) has S slices; every slice has its own A per slot and its own
rows of B. B rows of slice s are `slice_offsets[s] : slice_offsets[s] + slice_sizes[s]`,
which are also the output columns (plus `y_offset`) the slice's delta is added to.

DoRA (optional, the slot pool's stacks have it): a slot flagged in `dora_flags` rescales its rows of the linear's
whole output after the LoRA delta, y = y * dora_scale[slot] + dora_shift[slot] (scale = m / ||W + s B A||_row,
shift = (1 - scale) * bias, both per output column, computed once per adapter when its slot is written); other
slots keep scale 1 and shift 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from adapters.lora_ops.cpu_packed import PackedSlot, packed_slot_weights, packing_available
from adapters.lora_ops.cpu_stacked import (OWN_PAIR_AFTER_STEPS, STACKED_CACHE_SIZE, STACKED_MAX_ADAPTERS,
                                            StackedSlots, stacked_weights)


@dataclass(frozen=True)
class LoRAStack:
    lora_a: torch.Tensor  # [S, slots, R, in]
    lora_b: torch.Tensor  # [slots, N, R], N >= max(slice_offsets[s] + slice_sizes[s])
    ranks: torch.Tensor  # [S, slots] int32, real rank per (slice, slot); 0 = no LoRA
    scalings: torch.Tensor  # [S, slots] float32
    slice_offsets: tuple[int, ...]
    slice_sizes: tuple[int, ...]
    # Optional CPU mirrors (the slot pool keeps them) so the torch path never syncs.
    ranks_host: Optional[torch.Tensor] = None  # [S, slots] int32, CPU
    scalings_host: Optional[torch.Tensor] = None  # [S, slots] float32, CPU
    dora_scale: Optional[torch.Tensor] = None  # [slots, N] float32: DoRA's m / ||W + s B A||_row (1: no DoRA)
    dora_shift: Optional[torch.Tensor] = None  # [slots, N] float32: (1 - scale) * bias (0: no DoRA or no bias)
    dora_flags: Optional[torch.Tensor] = None  # [slots] int32, 1: the slot rescales this linear's output
    dora_host: Optional[torch.Tensor] = None   # [slots] bool, CPU mirror of dora_flags
    slice_meta: torch.Tensor = field(init=False, repr=False)  # [2, S] int32 on lora_b.device
    # fused_slot's, packed_slot's and stacked_slots' cache: {(slot, dtype): (A, B), ("packed", slot, dtype):
    # PackedSlot, ("stacked", slots, dtype): StackedSlots, "live": the slots with a rank, "run": (the last mix, its
    # steps in a row)}, valid while its "version" entry matches the tensors' version counters; at most
    # STACKED_CACHE_SIZE stacked entries of steps' own mixes (the least recently used goes first) and the pool's
    _fused: dict = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.lora_a.dim() != 4 or self.lora_b.dim() != 3:
            raise ValueError("lora_a must be [S, slots, R, in] and lora_b [slots, N, R]")
        s, slots, r, _ = self.lora_a.shape
        if self.lora_b.shape[0] != slots or self.lora_b.shape[2] != r:
            raise ValueError(
                f"lora_b {tuple(self.lora_b.shape)} does not match lora_a {tuple(self.lora_a.shape)}")
        if len(self.slice_offsets) != s or len(self.slice_sizes) != s:
            raise ValueError("need one (offset, size) per slice")
        if any(o < 0 or n <= 0 or o + n > self.lora_b.shape[1]
               for o, n in zip(self.slice_offsets, self.slice_sizes)):
            raise ValueError("slice rows out of range of lora_b")
        spans = sorted(zip(self.slice_offsets, self.slice_sizes))
        if any(o1 + n1 > o2 for (o1, n1), (o2, _) in zip(spans, spans[1:])):
            raise ValueError("slices overlap (the expand kernel writes them concurrently)")
        if tuple(self.ranks.shape) != (s, slots) or tuple(self.scalings.shape) != (s, slots):
            raise ValueError("ranks and scalings must be [S, slots]")
        if self.ranks.dtype != torch.int32 or self.scalings.dtype != torch.float32:
            raise ValueError("ranks must be int32 and scalings float32")
        if self.ranks.stride(-1) != 1 or self.scalings.stride(-1) != 1:
            raise ValueError("ranks and scalings need a unit stride over slots (kernels index them)")
        devices = {self.lora_a.device, self.lora_b.device, self.ranks.device, self.scalings.device}
        if len(devices) != 1:
            raise ValueError(f"LoRA stack tensors on several devices: {devices}")
        if self.ranks.device.type == "cpu" and self.ranks.numel() and \
                not 0 <= int(self.ranks.min()) <= int(self.ranks.max()) <= r:
            raise ValueError(f"ranks must be in [0, {r}]")  # (not checked on GPU: no device sync)
        if self.dora_scale is not None:
            n, dev = self.lora_b.shape[1], self.lora_b.device
            for t, shape, dtype in ((self.dora_scale, (slots, n), torch.float32),
                                    (self.dora_shift, (slots, n), torch.float32),
                                    (self.dora_flags, (slots,), torch.int32), (self.dora_host, (slots,), torch.bool)):
                if t is None or tuple(t.shape) != shape or t.dtype != dtype or t.stride(-1) != 1:
                    raise ValueError(f"DoRA tensors must be [slots, N] float32 scale / shift, [slots] int32 "
                                     f"flags and a [slots] bool host mirror")
            if {self.dora_scale.device, self.dora_shift.device, self.dora_flags.device} != {dev}:
                raise ValueError("DoRA tensors on another device than the stack")
        meta = torch.tensor([list(self.slice_offsets), list(self.slice_sizes)], dtype=torch.int32)
        object.__setattr__(self, "slice_meta", meta.to(self.lora_b.device))  # [2, S]

    @property
    def num_slices(self) -> int:
        return self.lora_a.shape[0]

    @property
    def num_slots(self) -> int:
        return self.lora_a.shape[1]

    @property
    def max_rank(self) -> int:
        return self.lora_a.shape[2]

    @property
    def in_features(self) -> int:
        return self.lora_a.shape[3]

    @property
    def has_dora(self) -> bool:
        """Whether any slot rescales this linear's output (host mirror: no device sync)."""
        return self.dora_host is not None and bool(self.dora_host.any())

    def dora_slots_host(self) -> frozenset[int]:
        if self.dora_host is None:
            return frozenset()
        return frozenset(torch.nonzero(self.dora_host).flatten().tolist())

    def _versions(self) -> tuple[int, ...]:
        """Version counters of the tensors a slot's fused weights are built from: any in-place write to them (a
        slot loaded or cleared through a view of the pool's buffers) bumps one."""
        ranks = self.ranks_host if self.ranks_host is not None else self.ranks
        scalings = self.scalings_host if self.scalings_host is not None else self.scalings
        return self.lora_a._version, self.lora_b._version, ranks._version, scalings._version

    def _check_version(self) -> None:
        """Drops every cached pair once the stack's tensors were written (their version counters moved)."""
        versions = self._versions()
        if self._fused.get("version") != versions:
            self._fused.clear()
            self._fused["version"] = versions

    def fused_slot(self, slot: int, dtype: torch.dtype) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """One slot's LoRA on this linear as two matrices in `dtype`: A [sum_r, in], every slice's A at its rank
        stacked, and B [N, sum_r], each slice's B rows in its own columns (zeros elsewhere) times its scaling. Then
        y[:, :N] += (x @ A.T) @ B.T is the slot's delta over all slices in two matmuls: the torch path's decode
        layout, where an op's dispatch costs more than its FLOPs. None when no slice of the slot has a rank.
        Built on first use and kept until a write to the stack's tensors (their version counters)."""
        self._check_version()
        key = (slot, dtype)
        if key not in self._fused:
            ranks = [row[slot] for row in self.host_ranks()]
            scalings = [row[slot] for row in self.host_scalings()]
            total = sum(ranks)
            if total == 0:
                self._fused[key] = None
                return None
            a = torch.cat([self.lora_a[s, slot, :r] for s, r in enumerate(ranks) if r]).to(dtype)   # [sum_r, in]
            b = torch.zeros(self.lora_b.shape[1], total, dtype=dtype, device=self.lora_b.device)    # [N, sum_r]
            col = 0
            for s, r in enumerate(ranks):
                if r:
                    off, n = self.slice_offsets[s], self.slice_sizes[s]
                    b[off:off + n, col:col + r] = self.lora_b[slot, off:off + n, :r].to(dtype) * scalings[s]
                    col += r
            self._fused[key] = (a, b)
        return self._fused[key]

    def packed_slot(self, slot: int, dtype: torch.dtype) -> Optional[PackedSlot]:
        """`fused_slot`'s pair reordered once for oneDNN (adapters/lora_ops/cpu_packed.py: the CPU's matmuls for
        groups of several rows); cached and invalidated with it. None when the slot has no rank here."""
        fused = self.fused_slot(slot, dtype)      # refreshes the cache when the tensors changed
        if fused is None:
            return None
        key = ("packed", slot, dtype)
        if key not in self._fused:
            self._fused[key] = packed_slot_weights(*fused)
        return self._fused[key]

    def stacking_slots(self, step_slots: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...]:
        """The slots of the stacked pair a step over `step_slots` takes. While the pool holds at most
        `STACKED_MAX_ADAPTERS` slots with a rank on this linear, the pool's pair, built once, serves every mix of
        them (the step's mask zeroes the columns of the slots it does not use, as it does another adapter's): keyed
        on each step's own mix, a pool of three adapters has seven mixes for `STACKED_CACHE_SIZE` = 4 entries, and
        steps whose mix changed rebuilt their linears' pairs on their clock (8-13x a call, docs/cpu.md). The step's
        own mix's pair when it is cached, or once that mix has run `OWN_PAIR_AFTER_STEPS` steps in a row (its
        build then pays for itself: the pool's pair costs a steady step of one rank-8 adapter ~10% more). With
        more slots than that in the pool: the step's own, as always."""
        self._check_version()
        live = self._fused.get("live")
        if live is None:
            ranks = self.host_ranks()
            live = self._fused["live"] = tuple(slot for slot in range(self.num_slots)
                                               if any(row[slot] for row in ranks))
        if len(live) > STACKED_MAX_ADAPTERS or step_slots == live:
            return step_slots                    # (a slot without a rank here adds nothing to a pair)
        run_slots, run = self._fused.get("run", ((), 0))
        run = run + 1 if run_slots == step_slots else 1
        self._fused["run"] = (step_slots, run)
        if run >= OWN_PAIR_AFTER_STEPS or ("stacked", step_slots, dtype) in self._fused:
            return step_slots
        return live

    def stacked_slots(self, slots: tuple[int, ...], dtype: torch.dtype) -> Optional[StackedSlots]:
        """The fused pairs of `slots` side by side (adapters/lora_ops/cpu_stacked.py: the CPU's LoRA for small
        decode batches of a few adapters), with oneDNN's packed copy on a CPU build that has it; cached with the
        fused pairs, at most `STACKED_CACHE_SIZE` sets of slots. None when no slot has a rank here or the stacked
        B is not finite."""
        versions = self._versions()
        key = ("stacked", slots, dtype)
        if self._fused.get("version") == versions and key in self._fused:
            self._fused[key] = self._fused.pop(key)                  # most recently used last
            return self._fused[key]
        pairs = [self.fused_slot(slot, dtype) for slot in slots]     # refreshes the cache when the tensors changed
        pool = self._fused.get("live")          # the pool's pair stays: every mix may take it (stacking_slots)
        stacked = [k for k in self._fused if isinstance(k, tuple) and k[0] == "stacked" and k[1] != pool]
        for old in stacked[:max(0, len(stacked) - STACKED_CACHE_SIZE + 1)]:
            del self._fused[old]
        pack = self.lora_b.device.type == "cpu" and packing_available()
        self._fused[key] = stacked_weights(slots, pairs, pack)
        return self._fused[key]

    def host_ranks(self) -> list[list[int]]:
        src = self.ranks_host if self.ranks_host is not None else self.ranks
        return src.tolist()

    def host_scalings(self) -> list[list[float]]:
        src = self.scalings_host if self.scalings_host is not None else self.scalings
        return src.tolist()

    @classmethod
    def from_slices(
        cls,
        a_list: Sequence[torch.Tensor],
        b_list: Sequence[torch.Tensor],
        ranks: Sequence[Sequence[int]],
        scalings: Sequence[Sequence[float]],
    ) -> "LoRAStack":
        """Stack per-slice tensors (A_s `[slots, R, in]`, B_s `[slots, out_s, R]`) into one
        stack whose B rows are the slices concatenated in order. Copies; for tests/tools."""
        a = torch.stack(list(a_list))  # [S, slots, R, in]
        b = torch.cat(list(b_list), dim=1)  # [slots, sum(out_s), R]
        sizes = tuple(int(t.shape[1]) for t in b_list)
        offsets = tuple(int(sum(sizes[:i])) for i in range(len(sizes)))
        dev = a.device
        return cls(
            lora_a=a, lora_b=b,
            ranks=torch.tensor(ranks, dtype=torch.int32, device=dev),
            scalings=torch.tensor(scalings, dtype=torch.float32, device=dev),
            slice_offsets=offsets, slice_sizes=sizes,
        )
