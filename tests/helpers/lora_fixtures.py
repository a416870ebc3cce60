"""PEFT LoRA adapters for the tiny test models, built with `peft` itself, and PEFT greedy references.

    path = adapter_dir("llama_gqa", "qv_r4")            # saved with `save_pretrained`, cached per process
    ids = peft_greedy("llama_gqa", "qv_r4", prompt_ids, 16)   # PeftModel (fp32) greedy continuation
    gap = peft_greedy_margin("llama_gqa", "qv_r4", prompt_ids, 16)  # min top-1/top-2 logit gap

Adapters have random, non-zero A and B (`init_lora_weights=False`, then an explicit seeded fill)
scaled so they clearly change greedy output vs the base while the greedy argmax keeps a clear
margin (a correct engine agrees with PEFT token for token in fp32).
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import shutil
from functools import lru_cache
from typing import Iterator
from pathlib import Path
from typing import Any

import torch

from scratch_dirs import scratch_dir
from testlib import _hf_model, _tokenizer, model_dir

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> (LoraConfig kwargs, B std multiplier, seed). The B std is `mult / sqrt(r)` per entry so the
# delta's size does not depend on the rank; `mult` is tuned so outputs clearly differ from the base.
ADAPTERS: dict[str, tuple[dict[str, Any], float, int]] = {
    "qv_r4": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), 1.5, 11),
    "all7_r8": (dict(r=8, lora_alpha=16, target_modules=ALL7), 0.5, 12),
    "rs_kod_r16": (dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj", "down_proj"]),
                   0.5, 13),
    # the same shape as all7_r8, other weights: "reload under the same name with different weights"
    "all7_r8_v2": (dict(r=8, lora_alpha=16, target_modules=ALL7), 0.5, 22),
    # the largest rank the tests' pools take (max_lora_rank 64), on the attention and MLP projections
    "qkvo_gu_r64": (dict(r=64, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj"]), 0.5, 15),
    # LoRA on the vocabulary (embedding and LM head, as PEFT targets them) and on q
    "vocab_r8": (dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "lm_head", "q_proj"]), 0.5, 16),
    # rank 96 > max_lora_rank 64 used by the tests
    "big_r96": (dict(r=96, lora_alpha=96, target_modules=["q_proj", "v_proj"]), 0.5, 14),
}
MAIN_ADAPTERS = ("qv_r4", "all7_r8", "rs_kod_r16")

_ROOT: Path | None = None
_DIRS: dict[tuple[str, str], Path] = {}


def _root() -> Path:
    global _ROOT
    if _ROOT is None:
        _ROOT = scratch_dir("loraplex_lora_")
    return _ROOT


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Tiny matmuls are fastest on one thread; on a busy 2-core box two threads spin (~20x slower)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _fresh_base(path: str) -> torch.nn.Module:
    # PEFT wraps the modules of the model it gets in place: never hand it conftest's shared instance.
    return copy.deepcopy(_hf_model(path))


def _fill_lora(model: torch.nn.Module, b_mult: float, seed: int) -> None:
    """A ~ N(0, 1/in), B ~ N(0, b_mult^2 / r): deterministic, non-zero, rank-independent delta size."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "lora_embedding_" in name:    # [r, vocab] / [hidden, r]: N(0, 1), as PEFT creates them
                p.copy_(torch.randn(p.shape, generator=gen))     # (else torch's global generator: test order)
            elif "lora_A" in name:      # [r, in]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            elif "lora_B" in name:    # [out, r]
                p.copy_(torch.randn(p.shape, generator=gen) * (b_mult / math.sqrt(p.shape[1])))


def _save_adapter(base: torch.nn.Module, kwargs: dict[str, Any], b_mult: float, seed: int, out: Path) -> Path:
    import peft

    cfg = peft.LoraConfig(init_lora_weights=False, bias="none", task_type="CAUSAL_LM", **kwargs)
    pm = peft.get_peft_model(base, cfg).eval()
    _fill_lora(pm, b_mult, seed)
    out.mkdir(parents=True, exist_ok=True)
    pm.save_pretrained(str(out), safe_serialization=True)
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    return out


def adapter_dir(model: str, adapter: str) -> Path:
    """Directory of PEFT adapter `adapter` (a key of ADAPTERS) for `conftest.model_dir(model)`."""
    key = (model, adapter)
    cached = _DIRS.get(key)
    if cached is not None and (cached / "adapter_model.safetensors").exists():
        return cached
    kwargs, mult, seed = ADAPTERS[adapter]
    out = _save_adapter(_fresh_base(str(model_dir(model))), kwargs, mult, seed, _root() / f"{model}__{adapter}")
    _DIRS[key] = out
    return out


def wrong_base_adapter_dir() -> Path:
    """A valid PEFT adapter for another Llama (hidden 48, intermediate 96): shapes do not fit ours."""
    key = ("__wrong_base__", "all7")
    cached = _DIRS.get(key)
    if cached is not None and (cached / "adapter_model.safetensors").exists():
        return cached
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=48, intermediate_size=96, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=512,
                                   max_position_embeddings=256)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).eval()
    out = _save_adapter(base, dict(r=8, lora_alpha=16, target_modules=ALL7), 0.5, 31, _root() / "wrong_base")
    _DIRS[key] = out
    return out


def corrupt_adapter_dir(model: str, adapter: str = "qv_r4") -> Path:
    """A copy of a good adapter whose adapter_model.safetensors is garbage (valid config)."""
    key = (model, f"__corrupt__{adapter}")
    cached = _DIRS.get(key)
    if cached is not None and (cached / "adapter_model.safetensors").exists():
        return cached
    good = adapter_dir(model, adapter)
    out = _root() / f"{model}__{adapter}__corrupt"
    shutil.copytree(good, out, dirs_exist_ok=True)
    data = (good / "adapter_model.safetensors").read_bytes()
    # a plausible header length that points past the end, followed by truncated junk
    (out / "adapter_model.safetensors").write_bytes(b"\xff" * 8 + data[8:64])
    json.loads((out / "adapter_config.json").read_text())  # the config itself stays readable
    _DIRS[key] = out
    return out


@lru_cache(maxsize=32)
def peft_model(model: str, adapter: str) -> torch.nn.Module:
    """`PeftModel.from_pretrained` of the saved adapter on a fresh fp32 copy of the base (eval)."""
    from peft import PeftModel

    base = _fresh_base(str(model_dir(model)))
    return PeftModel.from_pretrained(base, str(adapter_dir(model, adapter))).eval()


def _reference_model(model: str, adapter: str | None) -> torch.nn.Module:
    return _hf_model(str(model_dir(model))) if adapter is None else peft_model(model, adapter)


@lru_cache(maxsize=4096)
def _greedy(model: str, adapter: str | None, prompt_ids: tuple[int, ...],
            max_new_tokens: int) -> tuple[tuple[int, ...], float]:
    """Mirrors conftest._hf_greedy (stop at the generation_config EOS, EOS included)."""
    m = _reference_model(model, adapter)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad(), torch_threads(1):
        out = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=0, do_sample=False, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    tokens = tuple(out.sequences[0, len(prompt_ids):].tolist())
    margin = math.inf
    for step_logits in out.logits:  # one [1, vocab] per generated token
        top2 = torch.topk(step_logits[0].float(), 2).values
        margin = min(margin, float(top2[0] - top2[1]))
    return tokens, margin


def peft_greedy(model: str, adapter: str | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of `PeftModel` (fp32, CPU) for `adapter` (None = the bare base model)."""
    return list(_greedy(model, adapter, tuple(prompt_ids), max_new_tokens)[0])


def peft_greedy_margin(model: str, adapter: str | None, prompt_ids: list[int], max_new_tokens: int) -> float:
    """Smallest top-1 minus top-2 logit gap over the reference's greedy steps."""
    return _greedy(model, adapter, tuple(prompt_ids), max_new_tokens)[1]


def assert_generate_equals_peft(llm: Any, model: str, names: dict[str, str],
                                reqs: list[tuple[list[int], str | None]], max_tokens: int) -> None:
    """`llm.generate` of (prompt ids, served adapter name or None) pairs, greedy, gives `PeftModel`'s tokens for every
    request (`names`: served name -> adapter fixture); each reference must have a clear logit margin."""
    from core import SamplingParams

    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in reqs],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0), lora=[lo for _, lo in reqs])
    for out, (ids, lora) in zip(outs, reqs):
        adapter = None if lora is None else names[lora]
        assert peft_greedy_margin(model, adapter, ids, max_tokens) > 1e-3, "test setup: reference near a tie"
        assert out.outputs[0].token_ids == peft_greedy(model, adapter, ids, max_tokens), (lora, out.request_id)


def norm_text(text: str) -> str:
    """The server's incremental detokenizer never emits the bytes of an unfinished UTF-8 character at the
    end of the output (tokenizers' DecodeStream), while a one-shot `decode` writes them as U+FFFD: the
    random tiny model often ends on such a byte token, so both sides drop trailing U+FFFD."""
    return text.rstrip("\ufffd")


def peft_text(model: str, adapter: str | None, prompt: str, max_new_tokens: int) -> str:
    """`PeftModel` (or bare base) greedy continuation of the text `prompt`, decoded by the model's tokenizer
    (`norm_text`): what a served greedy completion must return."""
    tok = _tokenizer(str(model_dir(model)))
    ids = peft_greedy(model, adapter, tok.encode(prompt), max_new_tokens)
    return norm_text(tok.decode(ids, skip_special_tokens=True))
