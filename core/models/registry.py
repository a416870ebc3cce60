"""The module family of each architecture: built from `ModelConfig.architecture`."""
from __future__ import annotations

from torch import nn

from core.config import ModelConfig
from core.models.gemma import GemmaForCausalLM
from core.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {"llama": LlamaForCausalLM, "gemma": GemmaForCausalLM}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    return MODEL_CLASSES[cfg.architecture]
