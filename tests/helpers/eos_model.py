"""A tiny test model whose greedy continuation of a prompt reaches EOS (random tiny models never do).

The EOS row of `lm_head` is set to `boost` times the row of the token greedy decoding picks at step `step`:
from then on EOS outscores every token at least where that token wins, so HF's greedy reference stops at EOS
after a few tokens, and a run with `ignore_eos` goes on past it. Built beside the tests, never in core/.
"""
from __future__ import annotations

import shutil
from functools import lru_cache
from pathlib import Path

from safetensors.torch import load_file, save_file

from scratch_dirs import scratch_dir
from testlib import _tokenizer, encode, hf_greedy, model_dir


@lru_cache(maxsize=4)
def eos_model_dir(name: str, prompt: str, step: int = 4, boost: float = 2.0) -> Path:
    """A copy of the tiny model `name` with the EOS logit raised (see the module doc); cached per process."""
    src = model_dir(name)
    eos = _tokenizer(str(src)).eos_token_id
    assert eos is not None
    ref = hf_greedy(src, encode(src, prompt), step + 1, stop_at_eos=False)
    target = ref[step]
    assert target != eos
    dst = scratch_dir(f"loraplex-eos-{name}-")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = load_file(dst / "model.safetensors")
    key = "lm_head.weight"
    assert key in weights, "a tied-embedding model would change its input embedding too: pick an untied one"
    head = weights[key].clone()   # [vocab, hidden]
    head[eos] = boost * head[target]
    weights[key] = head.contiguous()
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def eos_token_id(path: Path) -> int:
    return int(_tokenizer(str(path)).eos_token_id)

