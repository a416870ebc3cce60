"""Builds the TARGET of the draft-model speculative-decoding pair: the embedded demo model grown 22x, then trained.

The draft is `core/demo_model` (5.05M parameters: 4 layers x 256, vocab 4096). The target keeps its tokenizer
and is grown from it function-preservingly (Net2Net):

- width x3 (hidden 256 -> 768, heads 4 -> 12, KV heads 2 -> 6, MLP 704 -> 2112): every hidden unit, head, KV head
  and MLP unit is replicated 3 times (tiled: new unit j copies old unit j mod n), the weights that consume a
  replicated dimension are divided by 3. RMSNorm's RMS of a 3x-replicated vector is unchanged, a replicated
  head attends exactly like its original, so the logits are the demo model's;
- depth 4 -> 16: each original layer is followed by 3 identity blocks (random q/k/v/gate/up, zero o_proj and
  down_proj: the block adds 0 to the residual stream);
- then small noise (`noise` x each tensor's std, and on the zero projections) breaks the symmetry of the
  replicas, and the model trains for `minutes` on the demo model's corpus (`examples/train_demo_model.py`'s
  data pipeline, imported: same tokenized stdlib stream, same held-out 2%).

So the target is a bigger model that starts as the draft and moves away from it by training: its acceptance of
the draft's proposals is higher than an independently trained pair of these sizes would give (stated with the
results). A LoRA adapter for the target (rank 16 on q/k/v/o/gate/up/down, trained on the stdlib's asyncio/ as
`examples/make_demo_adapters.py` trains tenant-asyncio) measures what adapters cost in acceptance: the draft
always proposes with its own base weights.

Output (git-ignored, idempotent: rebuilt only when the settings change): benchmarks/.cache/spec_target/ (HF
config.json, model.safetensors in bfloat16, the demo tokenizer files, build.json with the losses) and
benchmarks/.cache/spec_target_lora/.

    nice -n 10 python benchmarks/build_spec_target.py [--minutes 20] [--adapter-minutes 3]
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import make_demo_adapters as adapters_recipe  # noqa: E402  (slice_files, token_stream, TARGETS)
import train_demo_model as demo_recipe  # noqa: E402  (load_token_stream, sample_batch, eval_loss, lr_at)

DEMO = ROOT / "core" / "demo_model"
CACHE = Path(__file__).resolve().parent / ".cache"
TARGET_DIR = CACHE / "spec_target"
ADAPTER_DIR = CACHE / "spec_target_lora"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
ADAPTER_SLICE = "tenant-asyncio"


@dataclass(frozen=True)
class TargetBuildConfig:
    width: int = 3                 # hidden / heads / KV heads / MLP units: each replicated this many times
    num_layers: int = 16           # original layers, each followed by identity blocks up to this depth
    noise: float = 0.01            # symmetry-breaking noise, relative to each tensor's std
    minutes: float = 20.0          # training budget of the grown model
    lr: float = 3e-4
    seq_len: int = 256
    batch_size: int = 4
    adapter_minutes: float = 3.0
    adapter_rank: int = 16
    adapter_lr: float = 2e-3
    seed: int = 0
    threads: int = 1


def _tile(w: torch.Tensor, dims: Iterable[int], width: int) -> torch.Tensor:
    for d in dims:
        w = torch.cat([w] * width, dim=d)
    return w


def grown_config(demo_cfg: Any, width: int, num_layers: int) -> Any:
    from transformers import LlamaConfig

    d = demo_cfg.to_dict()
    d.update(hidden_size=d["hidden_size"] * width, intermediate_size=d["intermediate_size"] * width,
             num_attention_heads=d["num_attention_heads"] * width, num_key_value_heads=d["num_key_value_heads"] * width,
             head_dim=demo_cfg.head_dim, num_hidden_layers=num_layers)
    d.pop("layer_types", None)
    return LlamaConfig(**d)


@torch.no_grad()
def grow(demo: torch.nn.Module, width: int, num_layers: int) -> torch.nn.Module:
    """The demo model widened `width` times and deepened to `num_layers` with identity blocks: same logits."""
    from transformers import LlamaForCausalLM

    old_layers = demo.model.layers
    assert num_layers % len(old_layers) == 0, "num_layers must be a multiple of the demo model's"
    per = num_layers // len(old_layers)
    torch.manual_seed(0)
    big = LlamaForCausalLM(grown_config(demo.config, width, num_layers)).to(torch.float32).eval()
    big.model.embed_tokens.weight.copy_(_tile(demo.model.embed_tokens.weight, [1], width))    # [V, w*H]
    big.lm_head.weight.copy_(_tile(demo.lm_head.weight, [1], width) / width)                 # consumes hidden
    big.model.norm.weight.copy_(_tile(demo.model.norm.weight, [0], width))
    for i, old in enumerate(old_layers):
        new = big.model.layers[i * per]
        for name, p in old.named_parameters():       # every 2-D weight is [out, in], both dimensions replicated
            grown = _tile(p, range(p.ndim), width)
            new.get_parameter(name).copy_(grown / width if p.ndim == 2 else grown)
        for j in range(1, per):                      # identity blocks: nothing reaches the residual stream
            ident = big.model.layers[i * per + j]
            ident.self_attn.o_proj.weight.zero_()
            ident.mlp.down_proj.weight.zero_()
    return big


@torch.no_grad()
def perturb(model: torch.nn.Module, scale: float, seed: int) -> None:
    """Adds `scale` x std noise to every weight (zero weights get `scale` x their fan-in's 1/sqrt)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.ndim < 2:
            continue
        std = float(p.std()) or 1.0 / math.sqrt(p.shape[1])
        p.add_(torch.randn(p.shape, generator=gen) * std * scale)


def train(model: torch.nn.Module, params: list[torch.nn.Parameter], stream: torch.Tensor, minutes: float,
          lr: float, cfg: Any, bos: int, seed: int, tag: str) -> tuple[int, float]:
    """AdamW with the demo recipe's warm-up + cosine schedule for a wall-clock budget; (steps, EMA loss)."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    budget, start, step, ema = minutes * 60.0, time.time(), 0, float("nan")
    sched = replace(cfg, lr=lr, warmup_steps=5)
    while (elapsed := time.time() - start) < budget:
        for group in opt.param_groups:
            group["lr"] = demo_recipe.lr_at(sched, step, elapsed / budget)
        x = demo_recipe.sample_batch(stream, cfg, bos, rng)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema = loss.item() if math.isnan(ema) else 0.9 * ema + 0.1 * loss.item()
        step += 1
        print(f"[{tag}] step {step} t={elapsed:.0f}s loss={loss.item():.3f} ema={ema:.3f}", flush=True)
    model.eval()
    return step, ema


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _up_to_date(out: Path, settings: dict) -> bool:
    meta = out / "build.json"
    return meta.exists() and json.loads(meta.read_text()).get("settings") == settings


def build_target(cfg: TargetBuildConfig) -> Path:
    """benchmarks/.cache/spec_target (rebuilt only when missing or built with other settings)."""
    from transformers import LlamaForCausalLM

    settings = {k: v for k, v in asdict(cfg).items() if not k.startswith("adapter_")}
    if _up_to_date(TARGET_DIR, settings):
        return TARGET_DIR
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    dcfg = replace(demo_recipe.DemoTrainConfig(), seq_len=cfg.seq_len, batch_size=cfg.batch_size)
    ids = demo_recipe.special_token_ids(DEMO)
    stream = demo_recipe.load_token_stream(DEMO, num_files=100_000)
    split = int(len(stream) * 0.98)                 # the demo model's own train / held-out split
    train_ids, val = stream[:split], stream[split:]
    bos = ids[demo_recipe.BOS]
    demo = LlamaForCausalLM.from_pretrained(str(DEMO), dtype=torch.float32).eval()
    target = grow(demo, cfg.width, cfg.num_layers)
    loss_draft = demo_recipe.eval_loss(demo, val, dcfg, bos)
    perturb(target, cfg.noise, cfg.seed)
    loss_grown = demo_recipe.eval_loss(target, val, dcfg, bos)
    steps, ema = train(target, list(target.parameters()), train_ids, cfg.minutes, cfg.lr, dcfg, bos, cfg.seed, "target")
    loss_target = demo_recipe.eval_loss(target, val, dcfg, bos)
    TARGET_DIR.mkdir(parents=True, exist_ok=True)
    target.to(torch.bfloat16).save_pretrained(str(TARGET_DIR), safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO / name, TARGET_DIR / name)
    report = {"settings": settings, "num_params_draft": _num_params(demo), "num_params_target": _num_params(target),
              "heldout_loss_draft": round(loss_draft, 4), "heldout_loss_grown_perturbed": round(loss_grown, 4),
              "heldout_loss_target": round(loss_target, 4), "train_steps": steps, "train_loss_ema": round(ema, 4),
              "tokens_per_step": cfg.seq_len * cfg.batch_size}
    (TARGET_DIR / "build.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report), flush=True)
    return TARGET_DIR


def build_adapter(cfg: TargetBuildConfig) -> Path:
    """benchmarks/.cache/spec_target_lora: a PEFT LoRA of the target trained on one stdlib slice."""
    import peft
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    settings = asdict(cfg)
    if _up_to_date(ADAPTER_DIR, settings):
        return ADAPTER_DIR
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    bos, eos = tok.token_to_id(demo_recipe.BOS), tok.token_to_id(demo_recipe.EOS)
    stream = adapters_recipe.token_stream(adapters_recipe.slice_files(adapters_recipe.TENANTS[ADAPTER_SLICE]), tok, eos)
    split = int(len(stream) * 0.95)
    train_ids, heldout = stream[:split], stream[split:]
    dcfg = replace(demo_recipe.DemoTrainConfig(), seq_len=cfg.seq_len, batch_size=cfg.batch_size)
    base = LlamaForCausalLM.from_pretrained(str(TARGET_DIR), dtype=torch.float32).eval()
    loss_base = demo_recipe.eval_loss(base, heldout, dcfg, bos)
    lcfg = peft.LoraConfig(r=cfg.adapter_rank, lora_alpha=2 * cfg.adapter_rank, lora_dropout=0.0,
                           target_modules=adapters_recipe.TARGETS, bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, lcfg)
    params = [p for p in model.parameters() if p.requires_grad]
    steps, ema = train(model, params, train_ids, cfg.adapter_minutes, cfg.adapter_lr, dcfg, bos, cfg.seed, "lora")
    loss_adapter = demo_recipe.eval_loss(model, heldout, dcfg, bos)
    ADAPTER_DIR.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(ADAPTER_DIR), safe_serialization=True)
    report = {"settings": settings, "slice": adapters_recipe.TENANTS[ADAPTER_SLICE], "train_steps": steps,
              "heldout_loss_base": round(loss_base, 4), "heldout_loss_adapter": round(loss_adapter, 4)}
    (ADAPTER_DIR / "build.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report), flush=True)
    return ADAPTER_DIR


def build_all(cfg: TargetBuildConfig = TargetBuildConfig()) -> tuple[Path, Path]:
    return build_target(cfg), build_adapter(cfg)


def parse_args() -> TargetBuildConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, value in asdict(TargetBuildConfig()).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    return TargetBuildConfig(**vars(p.parse_args()))


if __name__ == "__main__":
    print(build_all(parse_args()))
