"""Per-step LoRA batch metadata, built once per step and shared by every wrapped linear.

The flat batch has T tokens, each with a slot index (-1 = base model, no LoRA). LoRA
tokens are grouped by slot (stable sort of token positions by slot): group g covers
positions `[group_starts[g], group_starts[g] + group_sizes[g])` of `token_ids`, all of
slot `group_slots[g]`. Grouping by slot (not by runs of consecutive equal slots) lets a
kernel program reuse one slot's weight tile for every token of that slot in the step,
which is what makes decode batches (one token per request) efficient. Slots with no
tokens get no group, so they cost nothing; -1 tokens appear in no group.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence, Union

import numpy as np
import torch

from adapters.errors import LoRAContextError

SlotsLike = Union[Sequence[int], torch.Tensor]
ColumnLayout = tuple[tuple[int, int], ...]   # (slot, columns) of each block of a stacked pair's columns

# the torch path pads groups into one batched matmul while that computes at most this many times the LoRA rows
MAX_PADDING_FACTOR = 2
# runs of at least this many consecutive tokens of one slot (prefill chunks) take the torch path's slices of x and y
MIN_RUN_TOKENS = 32


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: pinned and non-blocking on CUDA (a pageable copy waits for the queued work)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass(frozen=True)
class TorchSplit:
    """The torch path's split of a step: `runs` (first row, number of rows, slot) of at least `MIN_RUN_TOKENS`
    consecutive tokens of one slot, computed on slices of x and y; `rest`, the metadata of the other LoRA tokens
    (None: there are none), computed in batched matmuls (`rest.padded`) or a loop over their groups."""

    runs: tuple[tuple[int, int, int], ...]
    rest: Optional["LoRABatchMeta"]


@dataclass(frozen=True)
class PaddedGroups:
    """The step's LoRA tokens laid out as `num_entries` x `width` rows for batched matmuls over slots (the CPU /
    torch path): entry e holds the tokens of one slot (padded with copies of some row up to `width`), so one
    `bmm` of [E, width, in] by the entries' A [E, in, r] covers every group. Entries are the slots
    `slot_lo .. slot_lo + E - 1` (slots between the groups' slots get an entry without tokens) when that range is
    at most twice the number of groups, so the stacks' weights are read through a view, never copied; otherwise
    (`slot_lo` None) they are the groups' slots and the weights are gathered. Built once per step."""

    num_entries: int
    width: int
    slot_lo: Optional[int]
    group_entries: tuple[int, ...]       # [G] entry of each group
    entry_slots: torch.Tensor            # [E] int64, slot of each entry
    src_rows: torch.Tensor               # [E * width] int64, token row of each padded position (padding: any row)
    valid_positions: Optional[torch.Tensor]   # [T_lora] int64, padded position of each token_ids entry; None: identity
    token_rows: torch.Tensor             # [T_lora] int64, token_ids (destination rows of the deltas)


@dataclass(frozen=True)
class LoRABatchMeta:
    """Token -> slot grouping for one flat batch (device tensors + host copies)."""

    num_tokens: int  # T of the flat batch (LoRA and base tokens)
    num_lora_tokens: int  # tokens with slot >= 0
    max_group_size: int  # largest number of tokens of one slot (grid sizing)
    token_ids: torch.Tensor  # [num_lora_tokens] int32, token positions grouped by slot
    token_ids_host: torch.Tensor  # [num_lora_tokens] int64 on the host, the same (nothing reads the device back)
    group_slots: torch.Tensor  # [G] int32, slot of each group (ascending)
    group_starts: torch.Tensor  # [G] int32, first position of the group in token_ids
    group_sizes: torch.Tensor  # [G] int32, tokens in the group (>= 1)
    group_slots_host: tuple[int, ...]
    group_starts_host: tuple[int, ...]
    group_sizes_host: tuple[int, ...]
    # (first token position, True) when the group's tokens are one contiguous range of the
    # flat batch (a prefill chunk): the torch path then slices instead of gathering.
    group_first_token: tuple[int, ...]
    group_contiguous: tuple[bool, ...]

    @property
    def num_groups(self) -> int:
        return len(self.group_slots_host)

    @property
    def has_lora(self) -> bool:
        return self.num_lora_tokens > 0

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    def check_num_tokens(self, num_tokens: int) -> None:
        if num_tokens != self.num_tokens:
            raise LoRAContextError(
                f"LoRA metadata was built for {self.num_tokens} tokens but the layer got "
                f"{num_tokens}; set the step's LoRA context before every forward"
            )

    @cached_property
    def torch_split(self) -> TorchSplit:
        """Long runs of one slot and the rest of the step's LoRA tokens; built on first use and kept (every wrapped
        linear of the step shares it)."""
        slots = self.token_slots_host.clone()                                                   # [T]
        change = torch.ones(self.num_tokens, dtype=torch.bool)                                 # [T] a run starts
        change[1:] = slots[1:] != slots[:-1]
        starts = torch.nonzero(change).squeeze(1)                                             # [num_runs]
        lengths = torch.diff(starts, append=torch.tensor([self.num_tokens]))                  # [num_runs]
        keep = (lengths >= MIN_RUN_TOKENS) & (slots[starts] >= 0)
        runs = tuple(zip(starts[keep].tolist(), lengths[keep].tolist(), slots[starts[keep]].tolist()))
        if not runs:
            return TorchSplit((), self)
        for first, size, _ in runs:
            slots[first:first + size] = -1
        rest = LoRABatchMeta.build(slots, self.device) if bool((slots >= 0).any()) else None
        return TorchSplit(runs, rest)

    @cached_property
    def launch_plans(self) -> dict[object, object]:
        """The step's memo of per-linear launch decisions (adapters/lora_ops/triton_ops.py): every wrapped linear
        of the step shares this metadata, and a linear's shrink and expand the same decisions."""
        return {}

    @cached_property
    def group_slots_array(self) -> np.ndarray:
        """[G] int64 numpy: the groups' slots (host), for indexing host rank tables."""
        return np.asarray(self.group_slots_host, dtype=np.int64)

    @cached_property
    def token_slots_host(self) -> torch.Tensor:
        """[T] int64 on the host: the slot of every token of the flat batch (-1: base)."""
        slots = torch.full((self.num_tokens,), -1, dtype=torch.int64)                        # [T]
        slots[self.token_ids_host] = self.grouped_slots_host
        return slots

    @cached_property
    def grouped_slots_host(self) -> torch.Tensor:
        """[T_lora] int64 on the host: the slot of each LoRA token in `token_ids`' (grouped) order."""
        return torch.repeat_interleave(torch.tensor(self.group_slots_host, dtype=torch.int64),
                                       torch.tensor(self.group_sizes_host, dtype=torch.int64))

    def other_slot_mask(self, layout: ColumnLayout, all_rows: bool) -> Optional[torch.Tensor]:
        """[rows, C] bool, True where a row's slot is not its column's, for columns in blocks of (slot, columns)
        (`layout`: a stacked pair's, adapters/lora_ops/cpu_stacked.py): the rows are the flat batch's (`all_rows`)
        or the LoRA tokens in grouped order. Built once per step and layout, shared by the step's linears of that
        layout; None when every row's slot owns every column (one adapter, every row its)."""
        key = (layout, all_rows)
        cache = self._masks
        if key not in cache:
            rows = self.token_slots_host if all_rows else self.grouped_slots_host                # [rows]
            col_slots = torch.repeat_interleave(torch.tensor([slot for slot, _ in layout], dtype=torch.int64),
                                                torch.tensor([n for _, n in layout], dtype=torch.int64))  # [C]
            mask = (rows[:, None] != col_slots[None, :]).to(self.device)                         # [rows, C]
            cache[key] = mask if bool(mask.any()) else None
        return cache[key]

    @cached_property
    def _masks(self) -> dict:
        return {}

    @cached_property
    def token_rows(self) -> torch.Tensor:
        """`token_ids` as int64 (the index ops' dtype), converted once per step for every wrapped linear."""
        return self.token_ids.long()                                          # [T_lora]

    @cached_property
    def padded(self) -> Optional[PaddedGroups]:
        """The padded layout of this step for batched matmuls, or None when padding would compute more than
        `MAX_PADDING_FACTOR` times the LoRA rows (a prefill chunk beside single decode tokens). Built on first use
        and kept: every wrapped linear of the step shares it."""
        if not self.has_lora:
            return None
        g, width = self.num_groups, self.max_group_size
        lo, hi = min(self.group_slots_host), max(self.group_slots_host) + 1
        dense = hi - lo <= MAX_PADDING_FACTOR * g
        num_entries = hi - lo if dense else g
        if num_entries * width > MAX_PADDING_FACTOR * self.num_lora_tokens:
            return None
        entries = tuple(s - lo for s in self.group_slots_host) if dense else tuple(range(g))
        token_rows = self.token_ids_host                                      # [T_lora]
        src = torch.zeros(num_entries * width, dtype=torch.int64)             # [E * width]
        pos = torch.empty(self.num_lora_tokens, dtype=torch.int64)            # [T_lora]
        for e, start, size in zip(entries, self.group_starts_host, self.group_sizes_host):
            pos[start:start + size] = torch.arange(e * width, e * width + size)
        src[pos] = token_rows
        identity = num_entries * width == self.num_lora_tokens and bool(
            torch.equal(pos, torch.arange(self.num_lora_tokens)))
        slots = torch.arange(lo, hi) if dense else torch.tensor(self.group_slots_host, dtype=torch.int64)  # [E]
        dev = self.device
        return PaddedGroups(num_entries=num_entries, width=width, slot_lo=lo if dense else None,
                            group_entries=entries, entry_slots=_to_device(slots, dev),
                            src_rows=_to_device(src, dev),
                            valid_positions=None if identity else _to_device(pos, dev),
                            token_rows=_to_device(token_rows, dev))

    @classmethod
    def build(
        cls,
        token_slots: SlotsLike,
        device: Union[torch.device, str] = "cpu",
        num_slots: int | None = None,
    ) -> "LoRABatchMeta":
        """Group a flat batch's per-token slots. Pass host data (list or CPU tensor):
        a device tensor is copied to the host first (one sync)."""
        slots = torch.as_tensor(token_slots, dtype=torch.int64).to("cpu")
        if slots.dim() != 1:
            raise ValueError(f"token_slots must be 1-D, got shape {tuple(slots.shape)}")
        num_tokens = int(slots.numel())
        if num_tokens and int(slots.min()) < -1:
            raise ValueError("token slot indices must be >= -1")
        if num_slots is not None and num_tokens and int(slots.max()) >= num_slots:
            raise ValueError(f"token slot index {int(slots.max())} >= num_slots {num_slots}")

        lora_pos = torch.nonzero(slots >= 0).squeeze(1)  # [T_lora]
        lora_slots = slots[lora_pos]  # [T_lora]
        order = torch.argsort(lora_slots, stable=True)  # [T_lora]
        token_ids = lora_pos[order]  # [T_lora], ascending inside each group
        group_slots, sizes = torch.unique_consecutive(lora_slots[order], return_counts=True)  # [G]
        starts = torch.cumsum(sizes, 0) - sizes  # [G]
        first = token_ids[starts]  # [G]
        last = token_ids[starts + sizes - 1]  # [G]
        contiguous = (last - first + 1) == sizes  # [G]

        # One host->device copy for all index tensors, each segment 16-byte aligned (4 int32): Triton
        # specializes pointers on alignment, and unaligned offsets that vary per step would compile new
        # kernel variants mid-serving.
        t_lora, g = int(token_ids.numel()), int(group_slots.numel())
        t_pad, g_pad = -(-t_lora // 4) * 4, -(-g // 4) * 4
        packed = torch.zeros(t_pad + 3 * g_pad, dtype=torch.int32)  # [T_lora + 3G, padded]
        for i, part in enumerate((group_slots, starts, sizes)):
            packed[t_pad + i * g_pad:t_pad + i * g_pad + g] = part
        packed[:t_lora] = token_ids
        packed = _to_device(packed, torch.device(device))
        return cls(
            num_tokens=num_tokens,
            num_lora_tokens=t_lora,
            max_group_size=int(sizes.max()) if g else 0,
            token_ids=packed[:t_lora],
            token_ids_host=token_ids,
            group_slots=packed[t_pad:t_pad + g],
            group_starts=packed[t_pad + g_pad:t_pad + g_pad + g],
            group_sizes=packed[t_pad + 2 * g_pad:t_pad + 2 * g_pad + g],
            group_slots_host=tuple(group_slots.tolist()),
            group_starts_host=tuple(starts.tolist()),
            group_sizes_host=tuple(sizes.tolist()),
            group_first_token=tuple(first.tolist()),
            group_contiguous=tuple(contiguous.tolist()),
        )
