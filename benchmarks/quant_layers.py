"""Quantized linears against bf16 cuBLAS on the same shapes, and against the bytes of their packed weights.

For issue 35's four Llama-3-8B linear shapes (gate/up 4096->14336, down 14336->4096, q/o 4096->4096, k/v
4096->1024) and token counts T in 1, 16, 64, 256, 1024, the median time of one forward of:
- bf16: `F.linear` (cuBLAS) on a bf16 weight;
- W4A16 (int4, groups of 128, asymmetric: uint8 zero points) and W8A16 (int8 per channel): `QuantLinear`, the Triton
  GEMM that dequantizes inside the kernel (core/quant/triton_gemm.py; each row names the launch plan of
  core/quant/gemm_plan.py it ran: tiles, split-K, or dequantize-once + cuBLAS);
- FP8 (e4m3 weights, one scale per output channel, activations quantized per token): `QuantLinear` through
  `torch._scaled_mm` (core/quant/fp8_mm.py; needs FP8 tensor cores, compute capability >= 8.9), and its parts
  (`fp8_parts`): the activation quantization kernel alone (core/quant/fp8_quant.py, checked bit for bit against
  its torch emulation), the torch-ops quantization it replaced, and `_scaled_mm` alone on e4m3 activations.
Each is first checked against its dequantized weight through `F.linear` in fp32 (relative error). Reported per T,
for each linear and for the sum over the four: the speedup over bf16 (and the worst shape's: issue 35's targets
hold for every shape, gpu_summary.py judges them on it), and the floor:
  floor = max((packed weight bytes + x + y) / read bandwidth, 2 x T x in x out / bf16 matrix rate)
(the FP8 floor also uses the bf16 rate: Hopper's FP8 rate is about twice it, not measured here).
Weights that would fit in L2 are rotated among copies. Times on a GPU are a CUDA graph's replay of the calls (the device
time, as decode steps run in the engine); the eager time (each call's host time included) is beside it, and stands
alone where a call cannot be captured (benchmarks/gpu_kernels.py `Bench.time_ms`). `--dry-run`: tiny shapes in the Triton interpreter on the
CPU (FP8 rows: "needs CUDA").
Usage: python benchmarks/quant_layers.py [--dry-run] [--name quant_layers]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--dry-run" in sys.argv:     # before triton is imported: the GEMM then runs in the CPU interpreter
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["LORAPLEX_QUANT_GEMM"] = "triton"
    os.environ["LORAPLEX_FUSED_OPS"] = "triton"        # the FP8 activation quantization kernel, interpreted

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F

from common import write_results
from core.quant import fp8_mm, fp8_quant
from core.quant.linear import QuantLinear
from gpu_cases import QUANT_FORMATS, QUANT_LAYERS, QUANT_TOKENS
from gpu_kernels import Bench, rel_err


def make_layer(fmt: str, fan_in: int, fan_out: int, dtype: torch.dtype, device: torch.device, seed: int):
    """A bf16 weight (fmt "bf16") or a QuantLinear with random codes, scales and zero points."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "bf16":
        return (torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5).to(device, dtype)
    if fmt == "fp8":
        q = QuantLinear(fan_in, fan_out, "float", 8, 1, False, dtype, device)
        q.qweight.copy_((torch.randn(fan_out, fan_in, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn))
        q.scales.copy_((torch.rand(fan_out, 1, generator=g) + 0.5) / (64 * fan_in ** 0.5))
        q.finalize()                                   # as the loader does: fp32 column scales on CUDA
        return q
    bits = 4 if fmt == "w4a16" else 8
    groups = -(-fan_in // 128) if bits == 4 else 1
    q = QuantLinear(fan_in, fan_out, "int", bits, groups, False, dtype, device)
    if bits == 4:
        q.qweight.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, q.qweight.shape, generator=g, dtype=torch.int32))
    else:
        q.qweight.copy_(torch.randint(0, 256, q.qweight.shape, generator=g, dtype=torch.uint8))
    q.zeros.copy_(torch.randint(0, 2 ** bits, q.zeros.shape, generator=g).to(q.zeros.dtype))
    q.scales.copy_(((torch.rand(fan_out, groups, generator=g) + 0.5) / (2 ** bits * fan_in ** 0.5)).to(dtype))
    q.finalize()
    return q


def weight_nbytes(layer) -> int:
    if isinstance(layer, torch.Tensor):
        return layer.numel() * layer.element_size()
    return sum(b.numel() * b.element_size() for b in layer.buffers() if b is not None)


def forward(layer, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer) if isinstance(layer, torch.Tensor) else layer(x)


def reference(layer, x: torch.Tensor) -> torch.Tensor:
    w = layer if isinstance(layer, torch.Tensor) else layer.dequantize(torch.float32)
    if isinstance(layer, QuantLinear) and layer.kind == "float":      # the fp8 path quantizes x per token too
        xq, sx = fp8_mm.quantize_activations(x, None)
        x = xq.float() * sx
    return F.linear(x.float(), w.float())


def measure(b: Bench, layers: dict[str, tuple[int, int]], tokens: list[int], dtype: torch.dtype) -> list[dict]:
    rows = []
    for fmt in QUANT_FORMATS:
        if fmt == "fp8" and not (b.device.type == "cuda" and torch.cuda.get_device_capability(b.device) >= (8, 9)):
            rows += [{"format": fmt, "tokens": t, "ms": None, "note": "needs CUDA (FP8 tensor cores, sm >= 8.9)"}
                     for t in tokens]
            continue
        built = {name: make_layer(fmt, i, o, dtype, b.device, seed=k) for k, (name, (i, o)) in enumerate(layers.items())}
        copies = {name: [lay] + [make_layer(fmt, *layers[name], dtype, b.device, seed=100 + j)
                                 for j in range(b.copies(weight_nbytes(lay)) - 1)] for name, lay in built.items()}
        for t in tokens:
            per_layer, err = {}, 0.0
            for name, (fan_in, fan_out) in layers.items():
                x = torch.randn(t, fan_in, device=b.device, dtype=dtype)
                err = max(err, rel_err(forward(built[name], x), reference(built[name], x)))
                nbytes = weight_nbytes(built[name]) + (x.numel() + t * fan_out) * x.element_size()
                flops = 2 * t * fan_in * fan_out
                per_layer[name] = {"ms": b.time_ms([lambda lay=lay, x=x: forward(lay, x) for lay in copies[name]]),
                                   **b.last,
                                   "floor_ms": 1e3 * max(nbytes / b.bw, flops / b.flops), "bytes": nbytes,
                                   "flops": flops, "shape": [fan_in, fan_out], "plan": plan_name(built[name], x)}
            total_ms = sum(v["ms"] for v in per_layer.values())
            floor_ms = sum(v["floor_ms"] for v in per_layer.values())
            rows.append({"format": fmt, "tokens": t, "ms": total_ms, "floor_ms": floor_ms, "over_floor": total_ms /
                         floor_ms, "bytes": sum(v["bytes"] for v in per_layer.values()), "rel_err": err,
                         "layers": per_layer, "dry_run": b.dry})
    base = {r["tokens"]: r for r in rows if r["format"] == "bf16"}
    for r in rows:
        if r["ms"]:
            r["speedup_vs_bf16"] = base[r["tokens"]]["ms"] / r["ms"]
            for name, v in r["layers"].items():
                v["speedup_vs_bf16"] = base[r["tokens"]]["layers"][name]["ms"] / v["ms"]
            r["worst_layer"] = min(r["layers"], key=lambda name: r["layers"][name]["speedup_vs_bf16"])
            r["worst_speedup_vs_bf16"] = r["layers"][r["worst_layer"]]["speedup_vs_bf16"]
        else:
            r["speedup_vs_bf16"] = None
    return rows


def plan_name(layer, x: torch.Tensor) -> str:
    """Which path a layer ran: cuBLAS, the FP8 path, or the quantized GEMM's plan (tiles, splits)."""
    if isinstance(layer, torch.Tensor):
        return "cuBLAS"
    if layer.kind == "float":
        return "fp8"
    plan = layer.kernel_plan(x)
    if plan is None:
        return "torch (dequantize, matmul)"
    if plan.kind == "dequant":
        return "dequantize once + cuBLAS"
    t = plan.tiles
    return f"fused {t.block_m}x{t.block_n}x{t.block_k} split {plan.split_k}, {plan.num_programs(x.shape[0], layer.out_features)} programs"


def fp8_parts(b: Bench, layers: dict[str, tuple[int, int]], tokens: list[int], dtype: torch.dtype) -> list[dict]:
    """Per T, summed over the layer's linears: the FP8 activation quantization kernel, the torch ops it replaced,
    and `_scaled_mm` on already-quantized activations (what the FP8 layer adds to the raw GEMM). The kernel's codes
    and scales must equal the emulation's bit for bit (`exact`)."""
    if b.device.type == "cuda" and torch.cuda.get_device_capability(b.device) < (8, 9):
        return []
    built = {name: make_layer("fp8", i, o, dtype, b.device, seed=k) for k, (name, (i, o)) in enumerate(layers.items())}
    rows = []
    for t in tokens:
        row = {"tokens": t, "quant_ms": 0.0, "quant_torch_ms": 0.0, "scaled_mm_ms": 0.0, "exact": True,
               "quant_bytes": 0, "dry_run": b.dry}
        for name, (fan_in, fan_out) in layers.items():
            q = built[name]
            x = torch.randn(t, fan_in, device=b.device, dtype=dtype)
            codes, scales = fp8_quant.quantize_rows(x)
            ref_codes, ref_scales = fp8_quant.quantize_rows_torch(x, None)
            row["exact"] &= torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)) and \
                torch.equal(scales, ref_scales)
            sw = q.scales.float().reshape(1, -1)                                          # [1, out]
            row["quant_ms"] += b.time_ms([lambda x=x: fp8_quant.quantize_rows(x)])
            row["quant_torch_ms"] += b.time_ms([lambda x=x: fp8_quant.quantize_rows_torch(x, None)])
            row["scaled_mm_ms"] += b.time_ms([lambda c=codes, s=scales, q=q, sw=sw: torch._scaled_mm(
                c, q.qweight.t(), scale_a=s, scale_b=sw, out_dtype=dtype)])
            row["quant_bytes"] += t * fan_in * (x.element_size() + 1) + 4 * t
        row["quant_floor_ms"] = 1e3 * row["quant_bytes"] / b.bw
        rows.append(row)
    return rows


def fp8_parts_text(r: dict) -> str:
    where = " (dry run: CPU interpreter, not a GPU figure)" if r["dry_run"] else ""
    return (f"activation quantization {1e3 * r['quant_ms']:.1f} us (torch ops before: {1e3 * r['quant_torch_ms']:.1f} "
            f"us; bytes floor {1e3 * r['quant_floor_ms']:.2f} us), _scaled_mm alone {1e3 * r['scaled_mm_ms']:.1f} us; "
            f"kernel == emulation bit for bit: {r['exact']}{where}")


def timing_note(v: dict) -> str:
    """How the time was taken: a CUDA graph's replay (device time; the eager call's time beside it, host included)."""
    if v.get("graph_ms") is None:
        return "" if v.get("eager_ms") is None or v["eager_ms"] == v["ms"] else " [eager]"
    return f"; graph-replayed, eager {1e3 * v['eager_ms']:.1f} us"


def fmt_row(r: dict) -> str:
    if r["ms"] is None:
        return r["note"]
    where = " (dry run: CPU interpreter, not a GPU figure)" if r["dry_run"] else ""
    return (f"{1e3 * r['ms']:.1f} us = {r['speedup_vs_bf16']:.2f}x bf16 (worst shape {r['worst_layer']}: "
            f"{r['worst_speedup_vs_bf16']:.2f}x); floor {1e3 * r['floor_ms']:.1f} us -> "
            f"{r['over_floor']:.2f}x; rel err {r['rel_err']:.1e}{where}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--tokens", default=None, help="comma list of token counts")
    ap.add_argument("--name", default="quant_layers")
    args = ap.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    b = Bench(device, dry)
    layers = QUANT_LAYERS[dry]
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(QUANT_TOKENS[dry])
    dtype = torch.float32 if dry else torch.bfloat16
    with torch.inference_mode():
        rows = measure(b, layers, tokens, dtype)
        parts = fp8_parts(b, layers, tokens, dtype)
    tol = 1e-4 if dry else 3e-2
    bad = [f"{r['format']} T={r['tokens']}" for r in rows if r.get("rel_err") is not None and not r["rel_err"] <= tol]
    bad += [f"fp8 activation quantization T={r['tokens']} (kernel != emulation)" for r in parts if not r["exact"]]
    table = []
    for r in rows:
        table.append((f"{r['format']} T={r['tokens']}: the {len(layers)} linears of a layer", fmt_row(r)))
        table += [(f"{r['format']} T={r['tokens']}: {name} {v['shape'][0]}->{v['shape'][1]}",
                   f"{1e3 * v['ms']:.1f} us = {v['speedup_vs_bf16']:.2f}x bf16; floor {1e3 * v['floor_ms']:.1f} us "
                   f"({v['plan']}){timing_note(v)}")
                  for name, v in r.get("layers", {}).items()]
    table += [(f"fp8 parts T={r['tokens']}: the {len(layers)} linears of a layer", fp8_parts_text(r)) for r in parts]
    write_results(args.name, {"rows": rows, "fp8_parts": parts, "layers": layers, "dry_run": dry, "wrong": bad,
                              "read_bandwidth_gb_s": b.bw / 1e9, "matmul_tflops": b.flops / 1e12}, table)
    if bad:
        raise SystemExit(f"quantized linears disagree with their dequantized weights: {bad}")


if __name__ == "__main__":
    main()
