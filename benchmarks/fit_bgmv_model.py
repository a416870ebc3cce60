"""Refits the BGMV decode latency model (adapters/lora_ops/bgmv.py `config_cost_us`) to a kernels stage's sweep.

    python benchmarks/fit_bgmv_model.py benchmarks/results/gpu_run_h200_2026-11-27c/kernels.json [--check OTHER.json]

The kernels stage (benchmarks/gpu_kernels.py, `SWEEP` x `SWEEP_CONFIGS`) times shrink + expand at many (tiles, K
splits, column chunks) per shape; this fits the model's constants to those times (least squares of the relative
error, over the rows at the tiles the model may choose, at Triton's default warps and stages), prints them as
bgmv.py names them, the mean and worst relative error, the error on another run's sweep (`--check`), and per shape
the measured time of the config the refitted model ranks first against the fastest. Paste the constants into
bgmv.py when they predict better; tests/test_adapters/test_lora_bgmv.py holds the model to the sweeps.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.lora_ops.bgmv import BLOCK_M, effective_splits, max_groups, splits_per_load, tile_options  # noqa: E402

# the fused linears of the 8B shape the sweep times: (in features, slice outs)
LINEARS = {"q/k/v": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate/up": (4096, (14336, 14336)),
           "down": (14336, (4096,))}
# the model's constants, in the order of `features`
NAMES = ("SHRINK_ITERATION_US", "SHRINK_US_PER_KVALUES", "EXPAND_ITERATION_US", "EXPAND_US_PER_KVALUES",
         "PARTIALS_LOAD_US", "SHRINK_PROGRAM_US", "EXPAND_PROGRAM_US", "LAUNCH_PAIR_US")


def features(r: dict) -> np.ndarray:
    """A sweep row's terms of `config_cost_us`, one per constant of NAMES."""
    k, sizes = LINEARS[r["linear"]]
    block_r, bk, bn = max(16, r.get("rank", 16)), r.get("block_k", 64), r.get("block_n", 64)
    k_tiles, n_tiles = -(-k // bk), max(-(-n // bn) for n in sizes)
    splits = effective_splits(k_tiles, r["splits"])
    chunks = max(1, min(r["chunks"], n_tiles))
    shrink, expand = -(-k_tiles // splits), -(-n_tiles // chunks)
    grid = max_groups(r["rows"], r["slots"], BLOCK_M) * len(sizes)
    return np.array([shrink, shrink * bk * block_r / 1024, expand, expand * bn * block_r / 1024,
                     -(-splits // splits_per_load(block_r, BLOCK_M)) - 1, grid * splits, grid * chunks, 1.0])


def usable(rows: list[dict]) -> list[dict]:
    """The rows the model describes: tiles it may choose, Triton's default launch options, every slot in use."""
    return [r for r in rows if (r.get("block_k", 64), r.get("block_n", 64)) in tile_options(max(16, r.get("rank", 16)))
            and r.get("num_warps") is None and r.get("num_stages") is None and r.get("live", r["slots"]) == r["slots"]]


def fit(rows: list[dict]) -> np.ndarray:
    x = np.stack([features(r) for r in rows])                                 # [n, constants]
    y = np.array([1e3 * r["ms"] for r in rows])                               # [n] us
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)   # relative error
    return coef


def errors(rows: list[dict], coef: np.ndarray) -> np.ndarray:
    return np.array([features(r) @ coef / (1e3 * r["ms"]) - 1 for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", type=Path, help="a kernels stage's kernels.json")
    ap.add_argument("--check", type=Path, default=None, help="another run's kernels.json, not fitted to")
    args = ap.parse_args()
    rows = usable(json.loads(args.sweep.read_text())["sweep"])
    coef = fit(rows)
    for name, c in zip(NAMES, coef):
        print(f"{name} = {c:.4g}")
    err = np.abs(errors(rows, coef))
    print(f"fitted on {len(rows)} rows: mean error {err.mean():.3f}, worst {err.max():.3f}")
    if args.check:
        other = usable(json.loads(args.check.read_text())["sweep"])
        print(f"{args.check}: {len(other)} rows, mean error {np.abs(errors(other, coef)).mean():.3f}")
    shapes: dict[tuple, list[dict]] = {}
    for r in rows:
        shapes.setdefault((r["linear"], r.get("rank", 16), r["slots"], r["rows"]), []).append(r)
    for shape, rs in shapes.items():
        fastest = min(rs, key=lambda r: r["ms"])
        first = min(rs, key=lambda r: features(r) @ coef)
        print(f"{shape}: ranked first {first['name'].split(', ', 2)[-1]} {1e3 * first['ms']:.1f} us "
              f"({first['ms'] / fastest['ms']:.2f}x the fastest, {1e3 * fastest['ms']:.1f} us)")


if __name__ == "__main__":
    main()
