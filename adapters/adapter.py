"""A loaded LoRA adapter in host memory: per (layer, module) A and B with rank and scaling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch


@dataclass(frozen=True)
class LoRAModule:
    """LoRA factors of one unfused HF module: delta(x) = scaling * (x @ A^T) @ B^T."""

    lora_a: torch.Tensor  # [r, in] CPU
    lora_b: torch.Tensor  # [out, r] CPU
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])

    @property
    def nbytes(self) -> int:
        return self.lora_a.numel() * self.lora_a.element_size() + \
            self.lora_b.numel() * self.lora_b.element_size()


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """Everything the slot pool needs; validated against the base model's dims at load."""

    source: str  # what the caller passed (path or hub id)
    path: str  # resolved local directory
    modules: Mapping[tuple[int, str], LoRAModule]  # (layer index, HF module name) -> factors
    base_model_name_or_path: Optional[str] = None
    config: Mapping[str, Any] = field(default_factory=dict)  # raw adapter_config.json
    # MoE experts (adapters/peft/expert_keys.py): (layer, expert, "gate_proj" | "up_proj" | "down_proj") -> factors
    expert_modules: Mapping[tuple[int, int, str], LoRAModule] = field(default_factory=dict)

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in (*self.modules.values(), *self.expert_modules.values())), default=0)

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(name for _, name in self.modules) | \
            frozenset(f"experts.{name}" for _, _, name in self.expert_modules)

    @property
    def layers(self) -> frozenset[int]:
        return frozenset(layer for layer, _ in self.modules) | frozenset(k[0] for k in self.expert_modules)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in (*self.modules.values(), *self.expert_modules.values()))

    def module(self, layer: int, name: str) -> Optional[LoRAModule]:
        return self.modules.get((layer, name))
