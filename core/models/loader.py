"""Load an HF Llama-family checkpoint (local dir or hub id, safetensors) into our model.

Unfused q/k/v and gate/up tensors go to their slices of our fused linears; checkpoints that fuse them
already (Phi-3 `qkv_proj`, `gate_up_proj`) load as they are."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from core.attention.backend import AttentionBackend
from core.config import SUPPORTED_MODEL_TYPES, ModelConfig
from core.models.llama import LlamaForCausalLM
from core.models.registry import model_class
from core.models.meta_init import materialize, skip_param_init
from core.models.rope import layer_rotaries
from core.quant.config import detect_quantization
from core.quant.loader import finish_quantized, prepare_quantized, quantize_dummy

_STACKED = {  # HF name -> (our fused name, slice index)
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


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
    from huggingface_hub import constants, snapshot_download

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


def _slice_bounds(cfg: ModelConfig, fused: str) -> list[tuple[int, int]]:
    if fused == "qkv_proj":
        return [(0, cfg.q_size), (cfg.q_size, cfg.kv_size), (cfg.q_size + cfg.kv_size, cfg.kv_size)]
    return [(0, cfg.intermediate_size), (cfg.intermediate_size, cfg.intermediate_size)]


# A multimodal checkpoint (Gemma 3 saved by Gemma3ForConditionalGeneration): the language model's weights
# under a prefix, served as a text model; the vision tower and projector are not loaded.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_SKIPPED_PARTS = ("vision_tower", "multi_modal_projector", "rotary_emb")


def checkpoint_name(name: str) -> str | None:
    """The text model's name for a checkpoint tensor name; None for tensors not loaded."""
    if any(part in name for part in _SKIPPED_PARTS):
        return None
    for prefix, replacement in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


def _param_keys(cfg: ModelConfig, pname: str) -> list[str]:
    """What loading `pname` covers: one key per slice of a fused linear, else the name itself."""
    fused = pname.split(".")[-2]
    if fused in ("qkv_proj", "gate_up_proj"):
        return [f"{pname}#{start}" for start, _ in _slice_bounds(cfg, fused)]
    return [pname]


def load_weights(model: LlamaForCausalLM, model_dir: Path, skip: frozenset[str] = frozenset()) -> None:
    cfg = model.config
    params = dict(model.named_parameters())
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for file_name in f.keys():
                    name = checkpoint_name(file_name)
                    if name is None or file_name in skip:   # skip: tensors core.quant loaded
                        continue
                    tensor = f.get_tensor(file_name)
                    target, bounds = name, None
                    for hf, (fused, idx) in _STACKED.items():
                        if f".{hf}." in name:
                            target = name.replace(f".{hf}.", f".{fused}.")
                            bounds = _slice_bounds(cfg, fused)[idx]
                            break
                    if target not in params:
                        if target == "lm_head.weight" and cfg.tie_word_embeddings:
                            continue
                        raise ValueError(f"unexpected weight {name!r} in {file.name}")
                    param = params[target]
                    if bounds is None:
                        param.copy_(tensor)
                        loaded.update(_param_keys(cfg, target))   # Phi-3: qkv / gate_up fused in the file too
                    else:
                        param.narrow(0, bounds[0], bounds[1]).copy_(tensor)
                        loaded.add(f"{target}#{bounds[0]}")
    expected = {key for pname in params for key in _param_keys(cfg, pname)}
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint {model_dir} is missing weights: {sorted(missing)[:5]}")


def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights of the right shape (vLLM's `--load-format dummy`): benchmarks without checkpoints."""
    gen = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(0.0 if model.config.architecture == "gemma" else 1.0)   # Gemma norms scale by 1 + w
            else:
                p.normal_(0.0, 0.02, generator=gen)


def load_model(model_dir: Path, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
               dtype: torch.dtype, device: torch.device, load_format: str = "auto",
               quantization: str | None = None) -> LlamaForCausalLM:
    """Builds the module tree on the meta device (no random init), then fills it from the checkpoint."""
    with torch.device("meta"), skip_param_init():
        model = model_class(cfg)(cfg, backend, max_positions)
    model = materialize(model, device, dtype)
    for layer, rotary in zip(model.model.layers, layer_rotaries(cfg, max_positions)):
        layer.self_attn.rotary = rotary.to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if load_format == "dummy":
        init_dummy_weights(model)
        quantize_dummy(model, model_dir, quantization)
    else:
        quant = detect_quantization(model_dir, quantization)
        skip = prepare_quantized(model, model_dir, quant, dtype, device) if quant else frozenset()
        load_weights(model, model_dir, skip)
        if quant:
            finish_quantized(model, quant)
    return model.eval()
