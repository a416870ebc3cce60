"""A loaded LoRA adapter in host memory: per (layer, module) A and B with rank and scaling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch


@dataclass(frozen=True)
class LoRAModule:
    """LoRA factors of one unfused HF module: delta(x) = scaling * (x @ A^T) @ B^T. With `magnitude` (DoRA,
    PEFT's `use_dora`) the module's output is m / ||W + scaling * B A||_row * (x W^T + delta(x)) + bias.
    The embedding's LoRA (`LoRAAdapter.vocab_modules["embed_tokens"]`) keeps PEFT's layout: A [r, vocab]
    (a token's A column is gathered), B [hidden, r]."""

    lora_a: torch.Tensor  # [r, in] CPU
    lora_b: torch.Tensor  # [out, r] CPU
    scaling: float
    magnitude: Optional[torch.Tensor] = None  # [out] CPU: DoRA's magnitude vector (None: plain LoRA)

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])

    @property
    def nbytes(self) -> int:
        mag = 0 if self.magnitude is None else self.magnitude.numel() * self.magnitude.element_size()
        return self.lora_a.numel() * self.lora_a.element_size() + \
            self.lora_b.numel() * self.lora_b.element_size() + mag

    @property
    def is_dora(self) -> bool:
        return self.magnitude is not None


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """Everything the slot pool needs; validated against the base model's dims at load."""

    source: str  # what the caller passed (path or hub id)
    path: str  # resolved local directory
    modules: Mapping[tuple[int, str], LoRAModule]  # (layer index, HF module name) -> factors
    base_model_name_or_path: Optional[str] = None
    config: Mapping[str, Any] = field(default_factory=dict)  # raw adapter_config.json
    # LoRA on the vocabulary modules: "embed_tokens" (A [r, vocab], B [hidden, r]) and "lm_head" ([r, hidden],
    # [vocab, r]), as PEFT targets them (not modules_to_save)
    vocab_modules: Mapping[str, LoRAModule] = field(default_factory=dict)
    # MoE experts (adapters/peft/expert_keys.py): (layer, expert, "gate_proj" | "up_proj" | "down_proj") -> factors
    expert_modules: Mapping[tuple[int, int, str], LoRAModule] = field(default_factory=dict)

    def all_modules(self) -> tuple[LoRAModule, ...]:
        return (*self.modules.values(), *self.vocab_modules.values(), *self.expert_modules.values())

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.all_modules()), default=0)

    @property
    def has_dora(self) -> bool:
        return any(m.is_dora for m in self.all_modules())

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(name for _, name in self.modules) | \
            frozenset(f"experts.{name}" for _, _, name in self.expert_modules)

    @property
    def layers(self) -> frozenset[int]:
        return frozenset(layer for layer, _ in self.modules) | frozenset(k[0] for k in self.expert_modules)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.all_modules())

    def module(self, layer: int, name: str) -> Optional[LoRAModule]:
        return self.modules.get((layer, name))
