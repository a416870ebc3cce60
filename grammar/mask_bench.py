"""Time the batched bitmask apply: `python -m grammar.mask_bench [--device cuda]`.

Compares the torch reference path with the Triton kernel (CUDA) on logits of a real
vocabulary size, checks that both agree, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import time

import torch

from grammar.bitmask import apply_token_bitmask_torch_


def _time(fn, device: str, iters: int) -> float:  # noqa: ANN001
    """Median seconds per call."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 8, 64, 256])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    words = (args.vocab + 31) // 32
    use_triton = False
    if args.device == "cuda":
        from grammar.bitmask_triton import apply_token_bitmask_triton_, triton_available

        use_triton = triton_available()
    print(f"| batch | constrained rows | torch apply (ms) | triton apply (ms) | vocab {args.vocab}, {args.dtype}, "
          f"{args.device} |")
    print("| --- | --- | --- | --- | --- |")
    gen = torch.Generator().manual_seed(0)
    for batch in args.batch:
        logits = torch.randn(batch, args.vocab, generator=gen).to(args.device, dtype)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), generator=gen, dtype=torch.int64)
        bitmask = bitmask.to(torch.int32).to(args.device)
        for rows in (None, torch.arange(0, batch, 2, device=args.device)):
            n_rows = batch if rows is None else rows.numel()
            work = logits.clone()
            t_torch = _time(lambda: apply_token_bitmask_torch_(work, bitmask, rows), args.device, args.iters)
            t_triton = float("nan")
            if use_triton:
                ref = logits.clone()
                apply_token_bitmask_torch_(ref, bitmask, rows)
                got = logits.clone()
                apply_token_bitmask_triton_(got, bitmask, rows)
                assert torch.equal(got, ref), "triton and torch disagree"
                t_triton = _time(lambda: apply_token_bitmask_triton_(work, bitmask, rows), args.device, args.iters)
            print(f"| {batch} | {n_rows} | {t_torch * 1e3:.3f} | {t_triton * 1e3:.3f} | |")


if __name__ == "__main__":
    main()
