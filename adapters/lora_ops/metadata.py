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
from typing import Sequence, Union

import torch

from adapters.errors import LoRAContextError

SlotsLike = Union[Sequence[int], torch.Tensor]


@dataclass(frozen=True)
class LoRABatchMeta:
    """Token -> slot grouping for one flat batch (device tensors + host copies)."""

    num_tokens: int  # T of the flat batch (LoRA and base tokens)
    num_lora_tokens: int  # tokens with slot >= 0
    max_group_size: int  # largest number of tokens of one slot (grid sizing)
    token_ids: torch.Tensor  # [num_lora_tokens] int32, token positions grouped by slot
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
        target = torch.device(device)
        if target.type == "cuda":
            packed = packed.pin_memory().to(target, non_blocking=True)
        else:
            packed = packed.to(target)
        return cls(
            num_tokens=num_tokens,
            num_lora_tokens=t_lora,
            max_group_size=int(sizes.max()) if g else 0,
            token_ids=packed[:t_lora],
            group_slots=packed[t_pad:t_pad + g],
            group_starts=packed[t_pad + g_pad:t_pad + g_pad + g],
            group_sizes=packed[t_pad + 2 * g_pad:t_pad + 2 * g_pad + g],
            group_slots_host=tuple(group_slots.tolist()),
            group_starts_host=tuple(starts.tolist()),
            group_sizes_host=tuple(sizes.tolist()),
            group_first_token=tuple(first.tolist()),
            group_contiguous=tuple(contiguous.tolist()),
        )
