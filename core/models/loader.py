"""Finding an HF Llama-family checkpoint (local dir or hub id, safetensors) and naming its tensors; random
weights for `load_format="dummy"`. The model is built and filled by `core/distributed/rank_state.py` (one
loader for every tensor-parallel size, a single rank included)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from huggingface_hub import constants, snapshot_download

from core.config import SUPPORTED_MODEL_TYPES
from core.models.llama import LlamaForCausalLM


def resolve_model_path(model: str, revision: str | None = None, download_dir: str | None = None,
                       patterns: tuple[str, ...] = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt",
                                                    "*.jinja")) -> Path:
    """A local directory, or a hub id (at `revision`) resolved through the HF cache in `download_dir` (default:
    HF_HUB_CACHE), downloaded if allowed."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/")):
        raise FileNotFoundError(f"model path {model!r} is not a directory")

    kwargs = {"revision": revision, "cache_dir": download_dir, "allow_patterns": list(patterns)}
    try:
        return Path(snapshot_download(model, local_files_only=True, **kwargs))
    except Exception as exc:
        if constants.HF_HUB_OFFLINE:   # huggingface_hub's reading of HF_HUB_OFFLINE (no download allowed)
            where = f" in {download_dir}" if download_dir else ""
            raise FileNotFoundError(f"{model!r} (revision {revision or 'main'}) is not in the HF cache{where} "
                                    f"and HF_HUB_OFFLINE=1: {exc}") from None
        return Path(snapshot_download(model, **kwargs))


def check_architecture(config: dict[str, Any]) -> None:
    """A clear start-up error for a checkpoint we cannot run: custom modelling code (`auto_map`, whatever
    `--trust-remote-code` says: we never run a checkpoint's Python) or an architecture we do not implement."""
    model_type = config.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return
    custom = " needs custom modelling code (auto_map in config.json), which loraplex does not run even with " \
             "--trust-remote-code, and" if "auto_map" in config else ""
    raise ValueError(f"the checkpoint{custom} has model_type {model_type!r} (architectures "
                     f"{config.get('architectures')}); loraplex implements {', '.join(SUPPORTED_MODEL_TYPES)}")


# A multimodal checkpoint (Gemma 3 saved by Gemma3ForConditionalGeneration): the language model's weights
# under a prefix, served as a text model; the vision tower and projector are not loaded.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_SKIPPED_PARTS = ("vision_tower", "multi_modal_projector", "rotary_emb")


def checkpoint_name(name: str) -> str | None:
    """The text model's name for a checkpoint tensor name; None for tensors not loaded."""
    if any(part in name for part in _SKIPPED_PARTS):
        return None
    name = name.replace(".block_sparse_moe.", ".mlp.")   # Mixtral's hub name of its MoE block
    for prefix, replacement in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights of the right shape (vLLM's `--load-format dummy`): benchmarks without checkpoints."""
    gen = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(0.0 if model.config.architecture == "gemma" else 1.0)   # Gemma norms scale by 1 + w
            else:
                p.normal_(0.0, 0.02, generator=gen)
