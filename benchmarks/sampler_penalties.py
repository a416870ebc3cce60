"""Cost of sampling penalties: one batch-64 decode sampling step with every row carrying presence, frequency
and repetition penalties and a 300-entry logit_bias, against plain sampling of the same logits.

The step timed is what the engine runs after the forward: `PenaltyState.prepare` (host: per-row parameters,
one copy), `apply` (device: bias scatter, count gather, penalties), `sample` (temperature, top-p, seeded
Gumbel) and `record` (device: counts += sampled tokens). Requests carry 200-token prompts and 100 output
tokens already counted; their rows are filled once before timing, as in serving.

Usage: python benchmarks/sampler_penalties.py [--device cpu|cuda] [--vocab 32000] [--batch 64] [--iters 50]
Writes benchmarks/results/sampler_penalties_{device}.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from core.sampling.penalties import PenaltyState  # noqa: E402
from core.engine.request import Request, RequestStatus  # noqa: E402
from core.sampling.sampler import SamplingBatch, sample  # noqa: E402
from core.sampling.params import SamplingParams  # noqa: E402


def make_requests(batch: int, vocab: int, penalties: bool, rng: random.Random) -> list[Request]:
    reqs = []
    for i in range(batch):
        extra = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
                     logit_bias={t: rng.uniform(-5, 5) for t in rng.sample(range(vocab), 300)}) if penalties else {}
        params = SamplingParams(max_tokens=1000, temperature=0.8, top_p=0.95, seed=i, **extra)
        r = Request(request_id=f"r{i}", prompt_token_ids=[rng.randrange(vocab) for _ in range(200)],
                    sampling_params=params, max_tokens=1000, seed=i, eos_token_ids=frozenset({0}))
        r.status = RequestStatus.RUNNING
        for _ in range(100):
            r.append_token(rng.randrange(vocab))
        reqs.append(r)
    return reqs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(reqs: list[Request], logits: torch.Tensor, state: PenaltyState | None, iters: int) -> list[float]:
    device = logits.device
    times = []
    for it in range(iters + 5):
        sync(device)
        t0 = time.perf_counter()
        sbatch = SamplingBatch.from_requests(reqs, logits.shape[-1], device)
        pen = state.prepare(reqs) if state is not None else None
        tokens = sample(logits if pen is None else state.apply(logits, pen), sbatch)
        if pen is not None:
            state.record(pen, tokens)
        host = tokens.tolist()   # the engine reads the tokens back every step
        sync(device)
        if it >= 5:
            times.append(time.perf_counter() - t0)
        if state is not None:   # keep host and device counts in step, as the engine's append does
            for r, t in zip(reqs, host):
                r.append_token(t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    logits = torch.randn(args.batch, args.vocab, device=device) * 3                        # [N, V] float32
    rng = random.Random(0)
    plain_reqs = make_requests(args.batch, args.vocab, False, rng)
    pen_reqs = make_requests(args.batch, args.vocab, True, rng)
    state = PenaltyState(args.vocab, device)
    time_step(pen_reqs, logits, state, 0)   # first steps fill the rows (once per request, as in serving)
    plain = time_step(plain_reqs, logits, None, args.iters)
    penal = time_step(pen_reqs, logits, state, args.iters)
    state.check_integrity()
    p50_plain, p50_pen = statistics.median(plain), statistics.median(penal)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_threads": torch.get_num_threads(), "batch": args.batch, "vocab": args.vocab, "iters": args.iters,
        "plain_ms_p50": round(p50_plain * 1e3, 3), "penalties_ms_p50": round(p50_pen * 1e3, 3),
        "plain_ms_mean": round(statistics.mean(plain) * 1e3, 3),
        "penalties_ms_mean": round(statistics.mean(penal) * 1e3, 3),
        "overhead_p50_pct": round(100 * (p50_pen / p50_plain - 1), 1),
    }
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"sampler_penalties_{device.type}")
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = (f"# Sampling step with penalties vs plain ({result['device']})\n\n"
          f"Batch {args.batch}, vocab {args.vocab}, temperature 0.8 + top-p 0.95 + seeds; penalized rows: presence, "
          f"frequency and repetition penalties and a 300-entry logit_bias each (200 prompt + 100 output tokens). "
          f"Median of {args.iters} steps, tokens read back each step. "
          f"`python benchmarks/sampler_penalties.py --device {device.type}`"
          f"{' (2 CPU cores shared with other jobs: absolute times are noisy)' if device.type == 'cpu' else ''}\n\n"
          f"| sampling step | p50 | mean |\n| --- | --- | --- |\n"
          f"| plain | {result['plain_ms_p50']} ms | {result['plain_ms_mean']} ms |\n"
          f"| penalties + 300-entry bias on every row | {result['penalties_ms_p50']} ms | "
          f"{result['penalties_ms_mean']} ms |\n\nOverhead (p50): {result['overhead_p50_pct']}%\n")
    out.with_suffix(".md").write_text(md)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
