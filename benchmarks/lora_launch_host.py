"""The host's own time in the segmented LoRA launchers of an eager step (prefill and mixed steps past the mixed-step
graphs), with the kernel launches stubbed out: what our Python costs per wrapped linear, apart from Triton's
launcher and the device.

Why: on the H200 (2026-11-27f, the GPU run's `host` stage) an eager step with a 2,000-token chunk beside 64 decode
rows kept the host 80 ms in the 32-adapter mix against 32 ms for the base model, ~60 ms of it in the 128 LoRA
wrappers under cProfile. Each wrapper launches a shrink and an expand (adapters/lora_ops/triton_ops.py); before
each launch the launcher chose the table config and read the step's largest real rank from the host mirror. Both
are now decided once per step and linear (`launch_plan`), the config once per stack shape.

The step here has the 8B shape's 128 wrapped linears (32 layers x q/k/v, o, gate/up, down; 33 slots, rank 64
pools), a 2,000-token chunk on one adapter beside 64 decode rows on 32; every step builds a fresh metadata, as the
engine does. CPU only (the launches never reach a device):

    python benchmarks/lora_launch_host.py [--steps 50] [--name lora_launch_host_cpu]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from common import write_results
from adapters.lora_ops import triton_kernels as K
from adapters.lora_ops import triton_ops as T
from adapters.lora_ops.metadata import LoRABatchMeta
from adapters.lora_ops.stack import LoRAStack

HIDDEN, INTER, Q, KV = 4096, 14336, 4096, 1024
GROUPS = {"qkv": (HIDDEN, (Q, KV, KV)), "o": (Q, (HIDDEN,)), "gate_up": (HIDDEN, (INTER, INTER)),
          "down": (INTER, (HIDDEN,))}
NUM_LAYERS, NUM_SLOTS, MAX_RANK = 32, 33, 64


class _NoLaunch:
    """Stands for a Triton kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid: object):
        return lambda *args, **kwargs: None


def stacks() -> list[LoRAStack]:
    """128 stacks of the 8B shape's layout (views of one small buffer per group: no memory per layer)."""
    out = []
    for in_features, sizes in GROUPS.values():
        a = torch.empty(len(sizes), NUM_SLOTS, MAX_RANK, in_features, dtype=torch.bfloat16)   # [S, slots, R, in]
        b = torch.empty(NUM_SLOTS, sum(sizes), MAX_RANK, dtype=torch.bfloat16)                # [slots, N, R]
        offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        for layer in range(NUM_LAYERS):
            ranks = torch.tensor([[8 * (1 + (s + layer) % 8) for s in range(NUM_SLOTS)]] * len(sizes),
                                 dtype=torch.int32)
            out.append(LoRAStack(lora_a=a, lora_b=b, ranks=ranks, scalings=torch.ones(len(sizes), NUM_SLOTS),
                                 slice_offsets=offsets, slice_sizes=sizes, ranks_host=ranks.clone(),
                                 scalings_host=torch.ones(len(sizes), NUM_SLOTS)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--chunk", type=int, default=2000)
    ap.add_argument("--num-decoding", type=int, default=64)
    ap.add_argument("--name", default="lora_launch_host_cpu")
    args = ap.parse_args(argv)
    K.lora_shrink_kernel = K.lora_expand_kernel = _NoLaunch()
    T._interpreted = lambda t: False                      # the launchers' CUDA choices (tiles), not the interpreter's
    rng = random.Random(0)
    token_slots = [rng.randrange(32) for _ in range(args.num_decoding)] + [5] * args.chunk
    layers = stacks()
    x = {g: torch.empty(len(token_slots), in_f, dtype=torch.bfloat16) for g, (in_f, _) in GROUPS.items()}
    y = {g: torch.empty(len(token_slots), sum(sizes), dtype=torch.bfloat16) for g, (_, sizes) in GROUPS.items()}
    names = [g for g in GROUPS for _ in range(NUM_LAYERS)]
    per_step = []
    for _ in range(args.steps + 2):
        meta = LoRABatchMeta.build(token_slots, "cpu", num_slots=NUM_SLOTS)
        start = time.perf_counter()
        for name, stack in zip(names, layers):
            h = T.triton_shrink(x[name], stack, meta)
            T.triton_expand(y[name], h, stack, meta)
        per_step.append(time.perf_counter() - start)
    per_step = per_step[2:]                               # warm
    step_ms = 1e3 * statistics.median(per_step)
    rows = [("wrapped linears a step", str(len(layers))),
            ("host time of their launchers a step (launches stubbed)", f"{step_ms:.2f} ms (median of {args.steps})"),
            ("per wrapped linear (a shrink and an expand)", f"{1e3 * step_ms / len(layers):.1f} us")]
    write_results(args.name, {"steps": args.steps, "chunk": args.chunk, "num_decoding": args.num_decoding,
                              "step_ms": per_step, "step_ms_median": step_ms,
                              "us_per_linear": 1e3 * step_ms / len(layers)}, rows)


if __name__ == "__main__":
    main()
