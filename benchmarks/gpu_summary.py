"""Collects one GPU session's figures into benchmarks/results/gpu_serving.json (+ .md): the file our checks read.

Reads what the session's benchmarks wrote (same run, same device):
  serving_<tag>.json             benchmarks/serving.py       (rate sweep, compiles after the warm-up)
  lora_overhead_<tag>_all.json   benchmarks/lora_overhead.py (r16, all 7 modules, 8 and 32 adapters)
  decode_roofline_<tag>.json     benchmarks/decode_roofline.py (batch-1 step over the read-bandwidth bound)
  offline_throughput_<tag>.json  benchmarks/offline_throughput.py (vs HF generate at batch 64)
and checks them against the issue's targets; a missed target is listed, not hidden.
Usage: python benchmarks/gpu_summary.py --tag h100 --device "NVIDIA H100 80GB HBM3"
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS  # noqa: E402


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def saturation_rate(points: list[dict[str, Any]]) -> float | None:
    """The lowest finite offered rate the server could not keep up with (achieved < 90% of offered)."""
    for p in sorted((p for p in points if p["rate"] != float("inf")), key=lambda p: p["rate"]):
        if p["request_s"] < 0.9 * p["rate"]:
            return p["rate"]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tag", default="h100")
    ap.add_argument("--device", required=True)
    args = ap.parse_args()
    serving = load(f"serving_{args.tag}")
    lora = load(f"lora_overhead_{args.tag}_all")
    roof = load(f"decode_roofline_{args.tag}")
    offline = load(f"offline_throughput_{args.tag}")
    points = serving["points"] if serving else []
    sat = saturation_rate(points)
    out: dict[str, Any] = {
        "device": args.device, "date": datetime.date.today().isoformat(),
        "serving": [{"rate": "inf" if p["rate"] == float("inf") else p["rate"],
                     "ttft_p50_ms": 1e3 * p["ttft_p50_s"], "ttft_p99_ms": 1e3 * p["ttft_p99_s"],
                     "itl_p50_ms": 1e3 * p["itl_p50_s"], "itl_p99_ms": 1e3 * p["itl_p99_s"],
                     "output_tok_s": p["output_tok_s"], "errors": p["num_errors"]} for p in points],
        "saturation_rate": sat,
        "compiles_after_warmup": serving["compiles_after_warmup"] if serving else None,
        "lora_overhead_pct": {k: 100 * lora[f"k{k}"]["overhead"] for k in ("8", "32")} if lora else None,
        "decode_b1_step_over_roofline": next((p["step_over_roofline"] for p in roof["points"] if p["batch"] == 1),
                                             None) if roof else None,
        "offline_speedup_vs_hf_b64": offline["speedup_vs_hf"] if offline else None,
    }
    below = [p for p in out["serving"] if p["rate"] != "inf" and (sat is None or p["rate"] < sat)]
    checks = [
        ("0 Triton compiles after start-up", out["compiles_after_warmup"] == 0),
        ("0 errors", all(p["errors"] == 0 for p in out["serving"]) and bool(points)),
        ("below saturation: TTFT p99 <= 500 ms", bool(below) and all(p["ttft_p99_ms"] <= 500 for p in below)),
        ("below saturation: ITL p99 <= 2x ITL p50",
         bool(below) and all(p["itl_p99_ms"] <= 2 * p["itl_p50_ms"] for p in below)),
        ("LoRA overhead <= 5% (8 adapters), <= 10% (32)", bool(out["lora_overhead_pct"]) and
         out["lora_overhead_pct"]["8"] <= 5 and out["lora_overhead_pct"]["32"] <= 10),
        ("batch-1 decode step <= 1.10x the bandwidth bound", (out["decode_b1_step_over_roofline"] or 99) <= 1.10),
        ("offline >= 15x HF generate at batch 64", (out["offline_speedup_vs_hf_b64"] or 0) >= 15),
    ]
    out["targets_met"] = {name: ok for name, ok in checks}
    (RESULTS / "gpu_serving.json").write_text(json.dumps(out, indent=2))
    lines = [f"# GPU serving summary ({args.device}, {out['date']})", "", "| rate (req/s) | TTFT p50/p99 ms | "
             "ITL p50/p99 ms | output tok/s | errors |", "|---|---|---|---|---|"]
    lines += [f"| {p['rate']} | {p['ttft_p50_ms']:.0f} / {p['ttft_p99_ms']:.0f} | {p['itl_p50_ms']:.1f} / "
              f"{p['itl_p99_ms']:.1f} | {p['output_tok_s']:.0f} | {p['errors']} |" for p in out["serving"]]
    lines += ["", "| target | met |", "|---|---|"] + [f"| {n} | {'yes' if ok else '**no**'} |" for n, ok in checks]
    lines += ["", f"saturation rate: {sat}; compiles after warm-up: {out['compiles_after_warmup']}; LoRA overhead %: "
              f"{out['lora_overhead_pct']}; batch-1 step / roofline: {out['decode_b1_step_over_roofline']}; offline "
              f"speedup vs HF: {out['offline_speedup_vs_hf_b64']}"]
    (RESULTS / "gpu_serving.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
