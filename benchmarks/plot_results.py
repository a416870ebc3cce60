"""PNG plots of the GPU studies (needs matplotlib, which the benchmark machines have; the tests do not).

    python benchmarks/plot_results.py [--results benchmarks/results]

decode_roofline_*.json -> <name>.png: decode step and forward time vs batch size against the roofline.
serving_*.json -> <name>.png: throughput, TTFT p50/p99 and ITL p50/p99 vs request rate.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def plot_roofline(path: Path, plt) -> Path:
    data = json.loads(path.read_text())
    pts = data["points"]
    b = [p["batch"] for p in pts]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(b, [1e3 * p["roofline_s"] for p in pts], "k--", label="roofline (weights + KV at the measured bandwidth)")
    ax.plot(b, [1e3 * p["forward_s"] for p in pts], "o-", label="forward (graph replay)")
    ax.plot(b, [1e3 * p["step_s"] for p in pts], "s-", label="engine step (schedule + forward + sample)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("ms per step")
    ax.set_ylim(bottom=0)
    bw = data.get("read_bandwidth_gb_s", data["copy_bandwidth_gb_s"])
    ax.set_title(f"Decode step vs roofline ({bw:.0f} GB/s, context {pts[0]['context']:.0f})")
    ax.legend()
    ax.grid(alpha=0.3)
    out = path.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def plot_serving(path: Path, plt) -> Path:
    data = json.loads(path.read_text())
    workloads = data.get("workloads") or {"mix": data["points"]}   # older files: one sweep under "points"
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for name, pts in workloads.items():
        finite = [p for p in pts if math.isfinite(p["rate"])]
        x = [p["rate"] for p in finite]
        axes[0].plot(x, [p["output_tok_s"] for p in finite], "o-", label=name)
        axes[1].plot(x, [1e3 * p["ttft_p50_s"] for p in finite], "o-", label=f"{name} p50")
        axes[1].plot(x, [1e3 * p["ttft_p99_s"] for p in finite], "s--", label=f"{name} p99")
        axes[2].plot(x, [1e3 * p["itl_p50_s"] for p in finite], "o-", label=f"{name} p50")
        axes[2].plot(x, [1e3 * p["itl_p99_s"] for p in finite], "s--", label=f"{name} p99")
    axes[0].set_ylabel("output tok/s")
    axes[1].set_ylabel("TTFT (ms)")
    axes[2].set_ylabel("inter-token latency (ms)")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("HTTP serving sweep (multi-tenant mix vs base alone)")
    out = path.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for path in sorted(args.results.glob("decode_roofline_*.json")):
        print(plot_roofline(path, plt))
    for path in sorted(args.results.glob("serving_*.json")):
        print(plot_serving(path, plt))


if __name__ == "__main__":
    main()
