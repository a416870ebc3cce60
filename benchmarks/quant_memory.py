"""Device bytes of the weights for the Llama-3-8B shape: bf16 vs our quantized layouts, from the shapes alone.

The model is built on the meta device (no storage), then every decoder linear is swapped for the QuantLinear the
loader would build (its real buffers: packed codes, scales, zero points), so the bytes are those of our layout,
not a formula. Embeddings and lm_head stay bf16 (as checkpoints ship them: `ignore: [lm_head]`).

Usage: python benchmarks/quant_memory.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from common import LLAMA3_8B_CONFIG, write_results
from core.config import ModelConfig
from core.models.llama import LlamaForCausalLM
from core.models.meta_init import skip_param_init
from core.quant.config import TARGETS
from core.quant.linear import QuantLinear

# name -> (kind, bits, group size or None = per channel)
LAYOUTS = {"int4_g128": ("int", 4, 128), "int8_channel": ("int", 8, None), "fp8_channel": ("float", 8, None)}


def _bytes(module: nn.Module) -> int:
    tensors = list(module.parameters()) + [b for b in module.buffers() if b is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def _model() -> LlamaForCausalLM:
    cfg = ModelConfig.from_dict(LLAMA3_8B_CONFIG)
    with torch.device("meta"), skip_param_init():
        return LlamaForCausalLM(cfg, None, 16).to(torch.bfloat16)   # type: ignore[arg-type]


def measure() -> dict[str, dict[str, int]]:
    out = {}
    base = _model()
    linears = [(n, m) for n, m in base.named_modules() if n.rsplit(".", 1)[-1] in TARGETS]
    out["bf16"] = {"linear": sum(_bytes(m) for _, m in linears), "total": _bytes(base)}
    for name, (kind, bits, group) in LAYOUTS.items():
        model = _model()
        for mod_name, lin in [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in TARGETS]:
            groups = 1 if group is None else -(-lin.in_features // group)
            q = QuantLinear(lin.in_features, lin.out_features, kind, bits, groups, lin.bias is not None,
                            torch.bfloat16, "meta")
            parent, attr = mod_name.rsplit(".", 1)
            setattr(model.get_submodule(parent), attr, q)
        qlin = [m for n, m in model.named_modules() if isinstance(m, QuantLinear)]
        out[name] = {"linear": sum(_bytes(m) for m in qlin), "total": _bytes(model)}
    return out


def main() -> None:
    res = measure()
    bf16 = res["bf16"]
    table = [("bf16 linear layers (GB)", f"{bf16['linear'] / 1e9:.2f}"), ("bf16 whole model (GB)", f"{bf16['total'] / 1e9:.2f}")]
    for name in LAYOUTS:
        r = res[name]
        table += [(f"{name} linear layers (GB, x bf16)", f"{r['linear'] / 1e9:.2f} ({r['linear'] / bf16['linear']:.3f}x)"),
                  (f"{name} whole model (GB, x bf16)", f"{r['total'] / 1e9:.2f} ({r['total'] / bf16['total']:.3f}x)")]
    write_results("quant_memory", {"bytes": res, "config": "Llama-3-8B"}, table)


if __name__ == "__main__":
    main()
