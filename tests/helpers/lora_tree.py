"""A `--lora-dir` tree of many tiny PEFT adapters written straight in PEFT's file format (fast: ~1 ms each).

    root = adapter_tree(model_path, 1000)          # <root>/tenant-017/adapter-3/{adapter_config.json, ...}
    names = tree_names(1000)                       # the served names, in a fixed order
    add_corrupt(root, "bad/corrupt"); add_oversize(root, model_path, "bad/r128", 128)

Ranks cycle through 4..64 and target modules through four mixes; A ~ N(0, 1/in), B ~ N(0, 1.5^2 / r) so
every adapter clearly changes greedy output (as tests/helpers/lora_fixtures.py). PEFT loads these folders with
`PeftModel.from_pretrained`, which is the reference.
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import save_file

from scratch_dirs import scratch_dir

RANKS = (4, 8, 16, 32, 64)
MIXES = (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"],
         ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def tree_names(num: int, per_tenant: int = 10) -> list[str]:
    return [f"tenant-{i // per_tenant:03d}/adapter-{i % per_tenant}" for i in range(num)]


def _module_shapes(model_path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    cfg = json.loads((model_path / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    q, kv = heads * hd, cfg.get("num_key_value_heads", heads) * hd
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    return cfg["num_hidden_layers"], shapes   # module -> (in, out)


def write_adapter(out: Path, model_path: Path, rank: int, targets: list[str], seed: int,
                  b_mult: float = 1.5) -> Path:
    num_layers, shapes = _module_shapes(model_path)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for name in targets:
            in_f, out_f = shapes[name]
            key = f"base_model.model.model.layers.{layer}.{_PARENT[name]}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) / math.sqrt(in_f)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * (b_mult / math.sqrt(rank))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
           "target_modules": targets, "bias": "none", "init_lora_weights": False, "lora_dropout": 0.0,
           "base_model_name_or_path": str(model_path)}
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def spec_of(index: int) -> tuple[int, list[str]]:
    return RANKS[index % len(RANKS)], MIXES[(index // len(RANKS)) % len(MIXES)]


@lru_cache(maxsize=4)
def adapter_tree(model_path: Path, num: int) -> Path:
    root = scratch_dir("loraplex_tree_")
    for i, name in enumerate(tree_names(num)):
        rank, targets = spec_of(i)
        write_adapter(root / name, model_path, rank, targets, seed=1000 + i)
    return root


def add_corrupt(root: Path, name: str, model_path: Path) -> Path:
    """A valid config with garbage weights."""
    out = write_adapter(root / name, model_path, 4, ["q_proj"], seed=1)
    (out / "adapter_model.safetensors").write_bytes(b"\xff" * 8 + b"not a safetensors file")
    return out


@lru_cache(maxsize=64)
def _peft_model(model_path: Path, adapter_path: Path) -> torch.nn.Module:
    from peft import PeftModel

    from lora_fixtures import _fresh_base

    return PeftModel.from_pretrained(_fresh_base(str(model_path)), str(adapter_path)).eval()


def greedy_with_margin(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """Greedy continuation of an HF (or PEFT) model, fp32 (stops at EOS), and its smallest top-1/top-2 logit gap."""
    from lora_fixtures import torch_threads

    ids = torch.tensor([prompt_ids])
    with torch.no_grad(), torch_threads(1):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=0, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    margin = min(float(torch.topk(s[0].float(), 2).values.diff().abs()) for s in out.logits)
    return out.sequences[0, len(prompt_ids):].tolist(), margin


def peft_greedy_path(model_path: Path, adapter_path: Path, prompt_ids: list[int],
                     max_new_tokens: int) -> tuple[list[int], float]:
    """`PeftModel` (fp32) greedy continuation of the adapter folder, and its smallest top-1/top-2 logit gap."""
    return greedy_with_margin(_peft_model(model_path, adapter_path), prompt_ids, max_new_tokens)


def check_served_as_peft(path: Path, adapters: dict[str, Path], texts: list[str], max_tokens: int) -> None:
    """Every adapter on every text, served in one batch (fp32, CPU): greedy tokens equal `PeftModel`'s, each
    reference clear of a tie; the engine's invariants hold afterwards."""
    from core import LLM, SamplingParams
    from testlib import encode

    llm = LLM(str(path), lora_modules={n: str(p) for n, p in adapters.items()}, dtype="float32", device="cpu",
              max_loras=len(adapters), max_lora_rank=16)
    try:
        reqs = [(encode(path, t), name) for name in adapters for t in texts]
        outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in reqs],
                            SamplingParams(max_tokens=max_tokens, temperature=0.0), lora=[n for _, n in reqs])
        for out, (ids, name) in zip(outs, reqs):
            want, margin = peft_greedy_path(path, adapters[name], ids, max_tokens)
            assert margin > 1e-3, f"test setup: {name}'s reference is near a tie"
            assert out.outputs[0].token_ids == want, name
        llm.engine.check_integrity()
    finally:
        llm.shutdown()


def prompt_logprobs_as_reference(model: torch.nn.Module, ids: list[int], got: object) -> list[float]:
    """Asserts an output's prompt log-probs (`prompt_logprobs=0`) equal `model`'s log-softmax over the prompt
    within 1e-4; returns the reference's."""
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].log_softmax(-1)                   # [P, V]
    lps = [want[i, t].item() for i, t in enumerate(ids[1:])]
    assert got.prompt_logprobs is not None
    got_lps = [entry[1] for entry in got.prompt_logprobs[1:]]                         # (token, logprob, top)
    assert max(abs(a - b) for a, b in zip(lps, got_lps)) < 1e-4
    return lps
