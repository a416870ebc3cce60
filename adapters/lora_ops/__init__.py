"""Batched multi-LoRA ops for a flat batch: per-step metadata, shrink, expand."""

from adapters.lora_ops.dispatch import add_lora, expand, select_backend, shrink
from adapters.lora_ops.metadata import LoRABatchMeta
from adapters.lora_ops.stack import LoRAStack

__all__ = [
    "LoRABatchMeta",
    "LoRAStack",
    "add_lora",
    "expand",
    "select_backend",
    "shrink",
]
