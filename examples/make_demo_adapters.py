"""Train demo LoRA adapters ("tenants") for the embedded demo model (`core/demo_model/`) on CPU.

Each tenant gets a rank-8 LoRA on q/k/v/o/gate/up/down, trained with `peft` on HF `LlamaForCausalLM`
(training only; `loraplex serve` runs the result with its own model code) on a DISTINCT slice of the
Python standard library, so switching tenants visibly changes what the model writes:

    tenant-email    email/ + mailbox.py       (headers, MIME parts, mailboxes)
    tenant-asyncio  asyncio/                  (event loops, futures, transports)
    tenant-tests    unittest/                 (TestCase classes, assertions)

Output: `examples/adapters/<name>/` with `adapter_config.json`, `adapter_model.safetensors` (~0.6 MB)
and a README with the final losses. A fixed wall-clock budget per adapter, one CPU thread:

    nice -n 10 .venv/bin/python examples/make_demo_adapters.py --minutes 3
    nice -n 10 .venv/bin/python examples/make_demo_adapters.py --only tenant-email --minutes 1
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "core" / "demo_model"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# tenant name -> stdlib paths (directories are read recursively)
TENANTS: dict[str, list[str]] = {
    "tenant-email": ["email", "mailbox.py"],
    "tenant-asyncio": ["asyncio"],
    "tenant-tests": ["unittest"],
}
SAMPLE_PROMPTS = ["def ", "class ", "import "]


@dataclass(frozen=True)
class AdapterTrainConfig:
    minutes: float = 3.0          # wall-clock training budget per adapter
    out_dir: str = str(ROOT / "examples" / "adapters")
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.05
    seq_len: int = 256
    batch_size: int = 4
    lr: float = 3e-3
    warmup_steps: int = 10
    heldout_frac: float = 0.05
    seed: int = 0
    threads: int = 1              # 1 thread is fastest when niced on a shared 2-core machine


def parse_args() -> tuple[AdapterTrainConfig, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, value in asdict(AdapterTrainConfig()).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--only", nargs="+", choices=sorted(TENANTS), default=sorted(TENANTS),
                   help="train only these tenants (default: all)")
    args = vars(p.parse_args())
    only = args.pop("only")
    return AdapterTrainConfig(**args), only


def slice_files(parts: list[str]) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for part in parts:
        path = stdlib / part
        if path.is_dir():
            files.extend(p for p in sorted(path.rglob("*.py")) if "__pycache__" not in p.parts)
        elif path.is_file():
            files.append(path)
    if not files:
        raise SystemExit(f"no stdlib sources found for {parts} under {stdlib}")
    return files


def token_stream(files: list[Path], tok, eos: int) -> torch.Tensor:
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def sample_batch(stream: torch.Tensor, cfg: AdapterTrainConfig, bos: int, rng: random.Random) -> torch.Tensor:
    """BOS + a random window of `seq_len - 1` tokens (what the engine sees: prompts start with BOS)."""
    n = cfg.seq_len - 1
    starts = [rng.randrange(0, len(stream) - n) for _ in range(cfg.batch_size)]
    body = torch.stack([stream[s:s + n] for s in starts])
    return torch.cat([torch.full((cfg.batch_size, 1), bos, dtype=torch.long), body], dim=1)


@torch.no_grad()
def eval_loss(model: torch.nn.Module, stream: torch.Tensor, cfg: AdapterTrainConfig, bos: int) -> float:
    was_training = model.training
    model.eval()
    rng = random.Random(1234)
    losses = [float(model(input_ids=(x := sample_batch(stream, cfg, bos, rng)), labels=x).loss) for _ in range(6)]
    model.train(was_training)
    return sum(losses) / len(losses)


@torch.no_grad()
def greedy(model: torch.nn.Module, hf_tok, prompt: str, n: int = 24) -> str:
    ids = hf_tok(prompt, return_tensors="pt").input_ids
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=hf_tok.pad_token_id)
    return hf_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def lr_at(cfg: AdapterTrainConfig, step: int, frac: float) -> float:
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    return cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0))))


def train_one(name: str, cfg: AdapterTrainConfig, hf_tok, tok, ids: dict[str, int]) -> dict[str, object]:
    import peft
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    rng = random.Random(f"{cfg.seed}-{name}")
    files = slice_files(TENANTS[name])
    stream = token_stream(files, tok, ids["</s>"])
    split = int(len(stream) * (1.0 - cfg.heldout_frac))
    train, heldout = stream[:split], stream[split:]
    print(f"[{name}] {len(files)} files, {len(stream)} tokens ({len(heldout)} held out)", flush=True)

    base = LlamaForCausalLM.from_pretrained(str(DEMO_MODEL), dtype=torch.float32)
    base_loss = eval_loss(base, heldout, cfg, ids["<s>"])
    lcfg = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=TARGETS,
                           bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, lcfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    model.train()
    budget = cfg.minutes * 60.0
    start, step, ema = time.time(), 0, float("nan")
    while (elapsed := time.time() - start) < budget:
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step, elapsed / budget)
        x = sample_batch(train, cfg, ids["<s>"], rng)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema = loss.item() if math.isnan(ema) else 0.95 * ema + 0.05 * loss.item()
        step += 1
        if step % 25 == 0:
            print(f"[{name}] step {step} t={elapsed:.0f}s loss={loss.item():.3f} ema={ema:.3f}", flush=True)
    model.eval()
    lora_loss = eval_loss(model, heldout, cfg, ids["<s>"])
    print(f"[{name}] done: {step} steps, train loss (ema) {ema:.3f}, held-out loss base {base_loss:.3f} -> "
          f"adapter {lora_loss:.3f}", flush=True)

    out = Path(cfg.out_dir) / name
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = "loraplex-demo"  # not a machine-local path
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "adapter_model.safetensors").chmod(0o644)
    size = (out / "adapter_model.safetensors").stat().st_size
    samples = {p: greedy(model, hf_tok, p) for p in SAMPLE_PROMPTS}
    (out / "README.md").write_text(
        f"# {name}\n\n"
        f"LoRA (rank {cfg.rank}, alpha {cfg.alpha}, {', '.join(TARGETS)}) for the loraplex demo model, trained by "
        f"`examples/make_demo_adapters.py` for {cfg.minutes:g} min ({step} steps of {cfg.batch_size}x{cfg.seq_len} "
        f"tokens, 1 CPU thread) on the Python standard library's {' + '.join(TENANTS[name])} "
        f"({len(files)} files, {len(stream)} tokens).\n\n"
        f"- final train loss (EMA): {ema:.3f}\n"
        f"- held-out loss (last {cfg.heldout_frac:.0%} of the slice's tokens): base model {base_loss:.3f} -> with this adapter {lora_loss:.3f}\n"
        f"- adapter_model.safetensors: {size} bytes\n")
    return {"name": name, "steps": step, "train_loss_ema": round(ema, 3), "heldout_base": round(base_loss, 3),
            "heldout_adapter": round(lora_loss, 3), "bytes": size, "samples": samples}


def main() -> None:
    cfg, only = parse_args()
    torch.set_num_threads(cfg.threads)
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    hf_tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL))
    ids = {t: tok.token_to_id(t) for t in ("<s>", "</s>")}
    results = [train_one(name, cfg, hf_tok, tok, ids) for name in only]

    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(str(DEMO_MODEL), dtype=torch.float32).eval()
    print("\ngreedy samples (PEFT reference; `loraplex serve` gives the same text at temperature 0, float32):")
    for prompt in SAMPLE_PROMPTS:
        print(f"\n=== prompt {prompt!r}\n  {'base':<15} {greedy(base, hf_tok, prompt)!r}")
        for r in results:
            print(f"  {r['name']:<15} {r['samples'][prompt]!r}")  # type: ignore[index]
    print("\n" + json.dumps([{k: v for k, v in r.items() if k != "samples"} for r in results], indent=1))


if __name__ == "__main__":
    main()
