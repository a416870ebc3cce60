"""DoRA adapters (PEFT `use_dora=True`) for the tiny test models, saved by `peft` itself.

    path = save_dora_adapter(model_path, out, ["q_proj", "v_proj", "down_proj"], rank=8, seed=3)
    plain = plain_twin(path, out2)     # the same A / B without the magnitudes (use_dora off): plain LoRA

A and B are filled as tests/helpers/lora_fixtures.py does; every magnitude vector is PEFT's initial one (the
norm of W + s B A at init) times 1 + `jitter` N(0, 1), so DoRA's rescaling visibly changes the output against the
plain twin (the tests check it does).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lora_fixtures import _fill_lora, _fresh_base
from tiny_models import TinyModelSpec

# Qwen3 with biases on q/k/v and o (o's is row-parallel under tensor parallelism), head_dim 32 != hidden / heads
QWEN3_BIASED = TinyModelSpec(arch="qwen3", num_heads=4, num_kv_heads=2, head_dim=32, attention_bias=True, seed=5)


def save_dora_adapter(model_path: Path, out: Path, targets: list[str] | str, rank: int, seed: int,
                      b_mult: float = 0.5, jitter: float = 0.3, alpha: float | None = None, **kwargs) -> Path:
    import peft

    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets, use_dora=True,
                          init_lora_weights=False, bias="none", task_type="CAUSAL_LM", **kwargs)
    # PEFT initialises DoRA's magnitudes from W + its initial (random, init_lora_weights=False) B A, drawn from
    # torch's global generator: seeded here, so they do not depend on what ran before in the process (an engine's
    # warm-up draws from it: a test after one got other magnitudes and a reference near a tie, in CI only)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        pm = peft.get_peft_model(_fresh_base(str(model_path)), cfg).eval()
    _fill_lora(pm, b_mult, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in sorted(pm.named_parameters(), key=lambda kv: kv[0]):
            if "lora_magnitude_vector" in name:
                p.mul_(1.0 + jitter * torch.randn(p.shape, generator=gen))
    out.mkdir(parents=True, exist_ok=True)
    pm.save_pretrained(str(out), safe_serialization=True)
    return out


def plain_twin(dora: Path, out: Path) -> Path:
    """The DoRA adapter's A and B as a plain LoRA adapter (magnitudes dropped, use_dora off)."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in load_file(str(dora / "adapter_model.safetensors")).items()
             if "lora_magnitude_vector" not in k}
    save_file(state, str(out / "adapter_model.safetensors"))
    cfg = json.loads((dora / "adapter_config.json").read_text())
    cfg["use_dora"] = False
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def copy_adapter(src: Path, out: Path) -> Path:
    shutil.copytree(src, out, dirs_exist_ok=True)
    return out


def save_lora_adapter(model_path: Path, out: Path, targets: list[str], rank: int, seed: int,
                      b_mult: float = 1.0) -> Path:
    """A plain PEFT LoRA adapter (A, B filled as tests/helpers/lora_fixtures.py does) on any targets, the
    vocabulary modules included."""
    import copy

    from lora_fixtures import _save_adapter
    from testlib import _hf_model

    return _save_adapter(copy.deepcopy(_hf_model(str(model_path))),
                         dict(r=rank, lora_alpha=2 * rank, target_modules=targets), b_mult, seed, out)


def without_modules(src: Path, out: Path, names: tuple[str, ...]) -> Path:
    """The adapter with every weight of the named modules (e.g. embed_tokens, lm_head) dropped."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in load_file(str(src / "adapter_model.safetensors")).items()
             if not any(f"{n}." in k for n in names)}
    save_file(state, str(out / "adapter_model.safetensors"))
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg["target_modules"] = [t for t in cfg["target_modules"] if t not in names]
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out
