"""Quantized checkpoints into the model: QuantLinear in place of the targeted nn.Linear, filled from the files.

    skip = prepare_quantized(model, model_dir, scheme, dtype, device, shard)   # before the normal weight loading
    load_weights(model, model_dir, shard, skip=skip)                         # biases, norms, embeddings, lm_head
    finish_quantized(model, scheme)                                          # online FP8; pick the CPU kernels

(`core/distributed/rank_state.py` runs these.) With tensor parallelism (`shard`: a TPShard of several ranks)
each rank keeps only its rows (column-parallel q/k/v, gate/up) or input columns (row-parallel o, down) of
codes, scales, zeros and g_idx; a row-parallel split must fall on group boundaries, otherwise start-up fails
naming the module. A single rank (no shard, or a shard of world size 1) keeps whole tensors. The quantized
experts of an MoE model are cut the same way, on every expert's intermediate dimension (`_load_experts`).

Checkpoints that store q/k/v (gate/up) already fused (Phi-3 `qkv_proj`, `gate_up_proj`, quantized as one linear)
are read whole into the canonical, unpacked form and cut there into each part's (rank's) rows, so a part
boundary inside a packed word (AWQ, GPTQ zero points, compressed-tensors zero points) needs no alignment.
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from torch import nn

from core.models.meta_init import materialize
from core.models.moe import Experts
from core.quant.config import TARGETS, QuantScheme, UnsupportedQuantization, detect_quantization
from core.quant.formats import SUFFIXES, Canonical, read_canonical
from core.quant.experts import QuantExperts
from core.quant.linear import QuantLinear
from core.quant.packing import pack_rows

UNFUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ROW_PARALLEL = ("o_proj", "down_proj")
Piece = tuple[str, int, tuple[int, int] | None, tuple[int, int] | None]  # (HF name, dest row, rows, cols)


def _pieces(name: str, cfg: Any, shard: Any | None, fused_in_file: bool) -> list[Piece]:
    """Which HF linears fill our module `name`, where their rows go, and which rows / input columns we keep.
    `fused_in_file`: the checkpoint stores `name` itself (Phi-3): every part's rows come from that tensor."""
    parent, attr = name.rsplit(".", 1)
    if attr in ROW_PARALLEL:
        return [(name, 0, None, None if shard is None else shard.in_range(attr))]
    if attr not in UNFUSED:
        return [(name, 0, None, None)]
    sizes = {"q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size,
             "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size}
    out, dest, offset = [], 0, 0     # offset: where the part starts in a fused checkpoint tensor
    for hf in UNFUSED[attr]:
        start, size = shard.out_range(hf) if shard is not None else (0, sizes[hf])
        if fused_in_file:
            out.append((name, dest, (offset + start, size), None))
        else:
            out.append((f"{parent}.{hf}", dest, (start, size), None))
        dest, offset = dest + size, offset + sizes[hf]
    return out


def _targets(model: nn.Module, scheme: QuantScheme, cfg: Any, shard: Any | None,
             index: dict[str, Path]) -> dict[str, list[Piece]]:
    first = SUFFIXES[scheme.fmt][0]      # the codes tensor every quantized linear stores
    found = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in TARGETS or not isinstance(module, nn.Linear):
            continue
        pieces = _pieces(name, cfg, shard, fused_in_file=f"{name}.{first}" in index)
        ignored = {scheme.is_ignored(hf) for hf, *_ in pieces}
        if ignored == {True}:
            continue
        if len(ignored) > 1:
            raise UnsupportedQuantization(f"{name}: the checkpoint quantizes only some of {[p[0] for p in pieces]}")
        found[name] = pieces
    return found


def _slice_cols(c: Canonical, cols: tuple[int, int], scheme: QuantScheme, module: str) -> Canonical:
    """This rank's input columns of a row-parallel linear (codes, g_idx; scales/zeros by whole groups)."""
    start, size = cols
    codes = c.codes[:, start:start + size]
    if c.g_idx is not None:      # act-order: g_idx names global groups; every rank keeps all of them
        return replace(c, codes=codes, g_idx=c.g_idx[start:start + size])
    if c.scales.shape[1] == 1:   # per channel / per tensor
        return replace(c, codes=codes)
    gs = scheme.group_size or 1
    if start % gs or size % gs:
        raise ValueError(f"{module}: tensor-parallel shard of input columns [{start}, {start + size}) does not "
                         f"line up with the quantization group size {gs}; choose another --tensor-parallel-size")
    g0, ng = start // gs, size // gs
    zeros = None if c.zeros is None else c.zeros[:, g0:g0 + ng]
    return replace(c, codes=codes, scales=c.scales[:, g0:g0 + ng], zeros=zeros)


def _fill(q: QuantLinear, c: Canonical, dest: int, rows: tuple[int, int] | None) -> None:
    if rows is not None:
        start, size = rows
        c = replace(c, codes=c.codes[start:start + size], scales=c.scales[start:start + size],
                    zeros=None if c.zeros is None else c.zeros[start:start + size])
    n = c.codes.shape[0]
    if c.scales.shape[1] != q.num_groups:
        raise ValueError(f"{q}: checkpoint has {c.scales.shape[1]} scale groups, expected {q.num_groups}")
    codes = pack_rows(c.codes, 4) if q.num_bits == 4 and q.kind == "int" else c.codes
    q.qweight.narrow(0, dest, n).copy_(codes)
    q.scales.narrow(0, dest, n).copy_(c.scales)
    if q.zeros is not None:
        q.zeros.narrow(0, dest, n).copy_(c.zeros)
    if q.g_idx is not None:
        if dest and not torch.equal(q.g_idx, c.g_idx.to(q.g_idx.device)):
            raise UnsupportedQuantization(f"{q}: fused slices with different g_idx (act-order) permutations")
        q.g_idx.copy_(c.g_idx)
    if q.input_scale is not None:   # fused slices share one static activation scale: the largest (as vLLM)
        q.input_scale.copy_(torch.maximum(q.input_scale, c.input_scale.to(q.input_scale)) if dest else c.input_scale)


def _tensor_index(model_dir: Path) -> dict[str, Path]:
    index = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            index.update({name: file for name in f.keys()})
    return index


def _getter(index: dict[str, Path], stack: ExitStack) -> Callable[[str], torch.Tensor | None]:
    """Reads one tensor by name; each file is opened once (kept open by `stack`)."""
    handles: dict[Path, Any] = {}

    def get(name: str) -> torch.Tensor | None:
        if name not in index:
            return None
        file = index[name]
        if file not in handles:
            handles[file] = stack.enter_context(safe_open(str(file), framework="pt"))
        return handles[file].get_tensor(name)
    return get


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, attr = name.rsplit(".", 1)
    setattr(model.get_submodule(parent), attr, new)


def _hf_shape(hf: str, cfg: Any) -> tuple[int, int]:
    """(out, in) of an unsharded HF linear."""
    attr = hf.rsplit(".", 1)[-1]
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (cfg.q_size, h), "k_proj": (cfg.kv_size, h), "v_proj": (cfg.kv_size, h),
            "o_proj": (h, cfg.q_size), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
            "qkv_proj": (cfg.q_size + 2 * cfg.kv_size, h), "gate_up_proj": (2 * i, h)}[attr]


def prepare_quantized(model: nn.Module, model_dir: Path, scheme: QuantScheme, dtype: torch.dtype,
                      device: torch.device, shard: Any | None = None) -> frozenset[str]:
    """Swaps every quantized linear for a QuantLinear holding its (rank's) packed weights; returns the
    checkpoint tensor names consumed (the normal loader skips them). Online FP8 swaps nothing here."""
    if scheme.fmt == "fp8-online":
        return frozenset()
    if shard is not None and shard.world_size == 1:
        shard = None                     # a single rank keeps whole tensors (no column cut on group boundaries)
    cfg = model.config if shard is None else shard.cfg
    index = _tensor_index(model_dir)
    consumed: set[str] = set()
    with torch.no_grad(), ExitStack() as stack:
        get = _getter(index, stack)
        for name, pieces in _targets(model, scheme, cfg, shard, index).items():
            old = model.get_submodule(name)
            reduce = getattr(getattr(old, "tp", None), "all_reduce", None)
            q: QuantLinear | None = None
            read: dict[str, Canonical] = {}          # a fused checkpoint tensor is read once for all its parts
            for hf, dest, rows, cols in pieces:
                if hf not in read:
                    read[hf] = read_canonical(get, hf, scheme, *_hf_shape(hf, cfg))
                c = read[hf]
                if cols is not None:
                    c = _slice_cols(c, cols, scheme, hf)
                if q is None:
                    q = QuantLinear(old.in_features, old.out_features, scheme.kind, scheme.num_bits,
                                    c.scales.shape[1], old.bias is not None, dtype, device,
                                    has_g_idx=c.g_idx is not None, reduce=reduce, act_quant=scheme.activation)
                _fill(q, c, dest, rows)
                consumed.update(f"{hf}.{s}" for s in SUFFIXES[scheme.fmt] if f"{hf}.{s}" in index)
            assert q is not None
            _swap(model, name, q)
        for name, module in list(model.named_modules()):
            if isinstance(module, Experts):
                _load_experts(model, name, module, scheme, index, get, dtype, device, consumed, shard)
    _check_all_consumed(index, consumed, scheme)
    return frozenset(consumed)


_EXPERT_PROJ = {"gate": ("w1", "gate_proj"), "up": ("w3", "up_proj"), "down": ("w2", "down_proj")}


def _expert_linears(name: str, num_experts: int, index: dict[str, Path], first: str) -> list[dict[str, str]]:
    """Each expert's checkpoint linears {"gate" | "up" | "down": HF name} of our experts module `name`
    (Mixtral's hub checkpoints keep the MoE block under `block_sparse_moe`)."""
    prefixes = [name, name.replace(".mlp.", ".block_sparse_moe.")]
    out = []
    for e in range(num_experts):
        found = {}
        for part, projs in _EXPERT_PROJ.items():
            cands = [f"{p}.{e}.{proj}" for p in prefixes for proj in projs]
            hit = [c for c in cands if f"{c}.{first}" in index or f"{c}.weight" in index]
            found[part] = hit[0] if hit else cands[0]
        out.append(found)
    return out


def _load_experts(model: nn.Module, name: str, experts: Experts, scheme: QuantScheme, index: dict[str, Path],
                  get: Callable[[str], torch.Tensor | None], dtype: torch.dtype, device: torch.device,
                  consumed: set[str], shard: Any | None) -> None:
    """Swaps an MoE layer's experts for QuantExperts filled with each expert's packed gate/up and down (the float
    experts may be on the meta device: only their shapes are read); experts the checkpoint keeps in float
    (`ignore`) get their storage here and the normal loader fills them. With tensor parallelism (`shard`) each
    rank keeps its slice of every expert's intermediate dimension, as the dense MLP's: gate/up rows (with their
    scales and zeros), down input columns in whole quantization groups (`_slice_cols`), and the experts'
    all-reduce (`RowParallelExperts.tp`) moves to the QuantExperts."""
    first = SUFFIXES[scheme.fmt][0]
    linears = _expert_linears(name, experts.num_experts, index, first)
    quantized = {f"{hf}.{first}" in index and not scheme.is_ignored(hf) for lin in linears for hf in lin.values()}
    if quantized == {False}:
        materialize(experts, device, dtype)          # float experts (left on the meta device until now)
        return
    if len(quantized) > 1:
        raise UnsupportedQuantization(f"{name}: the checkpoint quantizes only some of the experts' projections")
    if scheme.fmt != "pack-quantized":
        raise UnsupportedQuantization(f"{scheme.method} ({scheme.fmt}) mixture-of-experts checkpoints; quantized "
                                      "experts are served from compressed-tensors pack-quantized (W4A16 / W8A16) only")
    size, hidden = experts.down_proj.shape[2], experts.down_proj.shape[1]        # this rank's I, and H
    inter = size if shard is None else shard.cfg.moe_intermediate_size          # the checkpoint's I
    rows = None if shard is None else (shard.rank * size, size)                 # this rank's slice of I
    reduce = getattr(getattr(experts, "tp", None), "all_reduce", None)
    q: QuantExperts | None = None
    for e, lin in enumerate(linears):
        gate, up = (read_canonical(get, lin[p], scheme, inter, hidden) for p in ("gate", "up"))
        down = read_canonical(get, lin["down"], scheme, hidden, inter)
        if rows is not None:
            down = _slice_cols(down, rows, scheme, lin["down"])
        if q is None:
            q = QuantExperts(experts, scheme.num_bits, gate.scales.shape[1], down.scales.shape[1], dtype, device,
                             reduce=reduce)
        _fill(q.gate_up_q[e], gate, 0, rows)
        _fill(q.gate_up_q[e], up, size, rows)
        _fill(q.down_q[e], down, 0, None)
        consumed.update(f"{hf}.{s}" for hf in lin.values() for s in SUFFIXES[scheme.fmt] if f"{hf}.{s}" in index)
    assert q is not None
    _swap(model, name, q)


def _check_all_consumed(index: dict[str, Path], consumed: set[str], scheme: QuantScheme) -> None:
    """Quantized tensors of a layer we keep in float (embeddings, lm_head): refuse them by name."""
    packed = tuple(f".{s}" for s in SUFFIXES[scheme.fmt] if s != "weight")
    left = sorted({n.rsplit(".", 1)[0] for n in index if n.endswith(packed) and n not in consumed})
    if left:
        raise UnsupportedQuantization(f"{scheme.method} checkpoint quantizes {', '.join(left[:3])} (we quantize "
                                      "only the decoder's linear layers; keep these in `ignore`)")


def _fp8_per_channel(linear: nn.Linear, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> QuantLinear:
    """vLLM's online FP8: e4m3 codes with one scale per output channel (amax / 448)."""
    w = linear.weight.detach().float()                                                # [out, in]
    scales = (w.abs().amax(dim=1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    q = QuantLinear(linear.in_features, linear.out_features, "float", 8, 1, linear.bias is not None,
                    linear.weight.dtype, linear.weight.device, reduce=reduce)
    q.qweight.copy_((w / scales).to(torch.float8_e4m3fn))
    q.scales.copy_(scales)
    if linear.bias is not None:
        q.bias.copy_(linear.bias)
    return q


def quantize_dummy(model: nn.Module, model_dir: Path, requested: str | None) -> None:
    """Random weights (`load_format="dummy"`) with `--quantization`: online FP8 quantizes them as it would a bf16
    checkpoint (benchmarks of the FP8 path at a real model's shape, no checkpoint); the other methods read packed
    weights from a checkpoint, so they are refused by name rather than ignored."""
    if requested is None:
        return
    scheme = detect_quantization(model_dir, requested)
    if scheme is None or scheme.fmt != "fp8-online":
        raise UnsupportedQuantization(f"--quantization {requested} with load_format dummy: random weights can only be "
                                      "quantized online (--quantization fp8 on an unquantized config)")
    finish_quantized(model, scheme)


def finish_quantized(model: nn.Module, scheme: QuantScheme) -> None:
    """After every weight is in: online FP8 quantizes the targeted linears; each QuantLinear picks its path."""
    with torch.no_grad():
        if scheme.fmt == "fp8-online":
            for name, module in list(model.named_modules()):
                if name.rsplit(".", 1)[-1] in TARGETS and isinstance(module, nn.Linear):
                    _swap(model, name, _fp8_per_channel(module, getattr(getattr(module, "tp", None),
                                                                        "all_reduce", None)))
        for module in model.modules():
            if isinstance(module, QuantLinear):
                module.finalize()
