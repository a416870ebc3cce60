"""Train the embedded demo model (`core/demo_model/`) offline on CPU.

A byte-level BPE tokenizer and a small Llama are trained on Python standard library
sources for a fixed wall-clock budget, so greedy / sampled completions look like
Python code. HF `LlamaForCausalLM` is used for training only; the engine serves the
result with its own model code.

    nice -n 10 .venv/bin/python examples/train_demo_model.py --minutes 8
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the packages first: tests/grammar/ would shadow grammar/
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))   # test-model builders: tests/helpers/tiny_models.py
from tiny_models import BOS, EOS, PAD, build_tokenizer, iter_stdlib_text, special_token_ids  # noqa: E402


@dataclass(frozen=True)
class DemoTrainConfig:
    """Model shape and optimisation settings for the demo model."""

    minutes: float = 8.0
    out_dir: str = str(ROOT / "core" / "demo_model")
    vocab_size: int = 4096
    tokenizer_files: int = 480
    num_layers: int = 4
    hidden_size: int = 256
    intermediate_size: int = 704
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 1024
    seq_len: int = 256
    batch_size: int = 4
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.05
    seed: int = 0
    threads: int = 1  # 1 beats 2 by 4-10x when niced and sharing 2 cores with other jobs


def parse_args() -> DemoTrainConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, value in asdict(DemoTrainConfig()).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    return DemoTrainConfig(**vars(p.parse_args()))


def load_token_stream(tok_dir: Path, num_files: int) -> torch.Tensor:
    """Tokenize stdlib files into one stream, files separated by EOS."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    texts = iter_stdlib_text(num_files, max_chars_per_file=200_000)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def sample_batch(stream: torch.Tensor, cfg: DemoTrainConfig, bos: int, rng: random.Random) -> torch.Tensor:
    """BOS + a random window of `seq_len - 1` tokens, like an engine prompt with BOS prepended."""
    n = cfg.seq_len - 1
    starts = [rng.randrange(0, len(stream) - n) for _ in range(cfg.batch_size)]
    body = torch.stack([stream[s : s + n] for s in starts])
    return torch.cat([torch.full((cfg.batch_size, 1), bos, dtype=torch.long), body], dim=1)


def lr_at(cfg: DemoTrainConfig, step: int, frac: float) -> float:
    """Linear warmup then cosine decay over the fraction of the time budget spent."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    return cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0))))


@torch.no_grad()
def eval_loss(model: torch.nn.Module, stream: torch.Tensor, cfg: DemoTrainConfig, bos: int) -> float:
    model.eval()
    rng = random.Random(1234)
    losses = [float(model(input_ids=(x := sample_batch(stream, cfg, bos, rng)), labels=x).loss) for _ in range(4)]
    model.train()
    return sum(losses) / len(losses)


def complete(model: torch.nn.Module, tok: object, prompt: str, sample: bool, n: int = 64) -> str:
    ids = tok(prompt, return_tensors="pt").input_ids  # type: ignore[operator]
    kw = dict(do_sample=True, temperature=0.8, top_p=0.95) if sample else dict(do_sample=False)
    out = model.generate(ids, max_new_tokens=n, pad_token_id=tok.pad_token_id, **kw)  # type: ignore[attr-defined]
    return prompt + tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)  # type: ignore[attr-defined]


def main() -> None:
    cfg = parse_args()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = Path(cfg.out_dir)
    t0 = time.time()
    build_tokenizer(out, vocab_size=cfg.vocab_size, seed_text_files=cfg.tokenizer_files)
    ids = special_token_ids(out)
    stream = load_token_stream(out, num_files=100_000)
    split = int(len(stream) * 0.98)
    train, val = stream[:split], stream[split:]
    print(f"tokenizer + data: {time.time() - t0:.1f}s, {len(stream)} tokens", flush=True)

    mcfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD],
    )
    model = LlamaForCausalLM(mcfg).train()
    nparams = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )
    budget = cfg.minutes * 60.0
    start, step, ema = time.time(), 0, float("nan")
    while (elapsed := time.time() - start) < budget:
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step, elapsed / budget)
        x = sample_batch(train, cfg, ids[BOS], rng)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()
        ema = value if math.isnan(ema) else 0.95 * ema + 0.05 * value
        step += 1
        if step % 20 == 0:
            print(f"step {step} t={elapsed:.0f}s loss={value:.3f} ema={ema:.3f}", flush=True)
    val_loss = eval_loss(model, val, cfg, ids[BOS])
    print(f"done: {step} steps, train loss (ema) {ema:.3f}, val loss {val_loss:.3f}", flush=True)

    model = model.to(torch.bfloat16).eval()
    model.generation_config.update(bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    model.save_pretrained(str(out), safe_serialization=True)
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    gen_cfg = {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))

    tok = AutoTokenizer.from_pretrained(out)
    fmodel = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    greedy = complete(fmodel, tok, "def fibonacci(n):", sample=False)
    torch.manual_seed(0)
    sampled = complete(fmodel, tok, "import os\n\ndef ", sample=True)
    print("greedy:\n" + greedy + "\n---\nsampled:\n" + sampled, flush=True)
    size = (out / "model.safetensors").stat().st_size
    readme = f"""# loraplex demo model

A tiny Llama ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads,
{cfg.num_kv_heads} KV heads, vocab {cfg.vocab_size}, {nparams / 1e6:.2f}M parameters, bfloat16,
{size} bytes) trained from scratch on CPU by `examples/train_demo_model.py` for
{cfg.minutes:g} minutes ({step} steps of {cfg.batch_size}x{cfg.seq_len} tokens) on Python
standard library sources. The byte-level BPE tokenizer was trained on the same text
(`tiny_models.build_tokenizer`). It only produces Python-looking text; it exists so the
gateway works fully offline.

- final train loss (EMA): {ema:.3f}
- held-out loss: {val_loss:.3f}
- settings: `{json.dumps(asdict(cfg) | {"out_dir": "core/demo_model"})}`

Greedy completion of `def fibonacci(n):`:

```python
{greedy}
```
"""
    (out / "README.md").write_text(readme)
    print(f"saved {out} ({size} bytes)")


if __name__ == "__main__":
    main()
