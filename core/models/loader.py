"""Load an HF Llama-family checkpoint (local dir or hub id, safetensors) into our model."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open

from core.attention.backend import AttentionBackend
from core.config import ModelConfig
from core.models.llama import LlamaForCausalLM
from core.models.meta_init import materialize, skip_param_init
from core.models.rope import RotaryEmbedding
from core.quant.config import detect_quantization
from core.quant.loader import finish_quantized, prepare_quantized

_STACKED = {  # HF name -> (our fused name, slice index)
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def resolve_model_path(model: str) -> Path:
    """A local directory, or a hub id resolved through the normal HF cache (download if allowed)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/")):
        raise FileNotFoundError(f"model path {model!r} is not a directory")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(model, allow_patterns=patterns, local_files_only=True))
    except Exception:
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            raise
        return Path(snapshot_download(model, allow_patterns=patterns))


def _slice_bounds(cfg: ModelConfig, fused: str) -> list[tuple[int, int]]:
    if fused == "qkv_proj":
        return [(0, cfg.q_size), (cfg.q_size, cfg.kv_size), (cfg.q_size + cfg.kv_size, cfg.kv_size)]
    return [(0, cfg.intermediate_size), (cfg.intermediate_size, cfg.intermediate_size)]


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
                for name in f.keys():
                    if "rotary_emb" in name or name in skip:   # skip: tensors core.quant loaded
                        continue
                    tensor = f.get_tensor(name)
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
                    else:
                        param.narrow(0, bounds[0], bounds[1]).copy_(tensor)
                    loaded.add(target if bounds is None else f"{target}#{bounds[0]}")
    expected = set()
    for pname in params:
        fused = pname.split(".")[-2]
        if fused in ("qkv_proj", "gate_up_proj"):
            expected.update(f"{pname}#{start}" for start, _ in _slice_bounds(cfg, fused))
        else:
            expected.add(pname)
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
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def load_model(model_dir: Path, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
               dtype: torch.dtype, device: torch.device, load_format: str = "auto",
               quantization: str | None = None) -> LlamaForCausalLM:
    """Builds the module tree on the meta device (no random init), then fills it from the checkpoint."""
    with torch.device("meta"), skip_param_init():
        model = LlamaForCausalLM(cfg, backend, max_positions)
    model = materialize(model, device, dtype)
    rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling).to(device)
    for layer in model.model.layers:
        layer.self_attn.rotary = rotary
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        quant = detect_quantization(model_dir, quantization)
        skip = prepare_quantized(model, model_dir, quant, dtype, device) if quant else frozenset()
        load_weights(model, model_dir, skip)
        if quant:
            finish_quantized(model, quant)
    return model.eval()
