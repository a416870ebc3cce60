"""Batched multi-LoRA ops for a flat batch: per-step metadata, shrink, expand, on the path the caller names."""

from adapters.lora_ops.backends import Backend, LoRABackends
from adapters.lora_ops.dispatch import add_lora, expand, shrink
from adapters.lora_ops.metadata import LoRABatchMeta
from adapters.lora_ops.stack import LoRAStack

__all__ = [
    "Backend",
    "LoRABackends",
    "LoRABatchMeta",
    "LoRAStack",
    "add_lora",
    "expand",
    "shrink",
]
