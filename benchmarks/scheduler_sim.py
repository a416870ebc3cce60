"""The latency_slo workload replayed against the real scheduler in simulated time: a policy study in seconds.

`benchmarks/latency_slo.py` measures the step-time budget (issue 36) on a real server, which takes ~15 minutes on a
quiet 2-core machine and is noisy on a shared one. This script runs the same request mix (Poisson arrivals, prompts
of 64-1024 tokens starting with one of 4 shared 32-token system prompts, outputs of 32-256 tokens, 3 of 4 requests
through an adapter) through `core.scheduling.Scheduler` and `core.kv.KVCacheManager` as the engine uses them,
with each step's wall time drawn from a linear cost model (the features of core/scheduling/step_time.py, times
`--coef`, with log-normal noise `--noise`) instead of running the model. The scheduler's own step-time model learns
from those times exactly as it learns from measured ones. It reports, per load and budget, the same figures as
latency_slo.py (TTFT p50/p99, ITL p50/p99 pooled over all token gaps, output tokens/s) and the ratios of its
targets, so a policy change can be tried here first and confirmed there.

The default `--coef` (seconds: per step, per prefill token, per decode row, per attention query-key pair, per LoRA
token, per step with prefill, per step with prefill and LoRA rows, per adapter in the step) is the step-time model's
fit to every step of both servers of a latency_slo.py run on this repo's 2-core CI machine (fp32, the native CPU
kernels and the fused CPU LoRA decode path; `--step-trace`, saturation and 50% load, the scheduler of
`latency_slo_cpu_backlog1.md`); the default `--noise` is that fit's log residual (0.16). With them (`--seeds 4
--num-requests 48`) the simulation of the final scheduler (the typical decode-only step as the auto budget's
yardstick, a 16-token minimum chunk) gives ITL p99/p50 2.21 and 2.05 and TTFT p50 2.11x and 2.13x at 50% and 80%
load, 0.97x at saturation, against 2.16-2.31, 1.50-1.87, 1.64-1.82x, 2.67-2.68x and 0.91-0.97x measured in two runs
(`latency_slo_cpu_typical{1,2}.md`): it overstates TTFT at 50% load and understates it at 80%, where both real
servers run 96-98% busy.
(Those figures are from before the step-time model's residual level, below: `--no-level` reproduces its model.)
The simulation is a model: it leaves out HTTP and JSON-schema masks, and the machine's noise is what `--noise`
and `--drift` say; the real figures are latency_slo.py's. `--drift SIGMA --drift-corr RHO` adds a machine that
runs above or below its mean for stretches (an AR(1) log factor), as this 2-core VM does: fitted to the lag-1 and
lag-10 correlations of its step-time residual (0.66, 0.33; total sigma 0.113), about 0.06 of independent noise and
a drift of 0.095 with a step-to-step correlation of 0.93. On that machine (`--coef 0.01209,0.0001004,0.0004477,
2.778e-07,7.441e-05,0.003,0,0.0009439 --noise 0.06 --drift 0.095 --seeds 6 --num-requests 32`, a later fit of this
machine's steps) the step-time model's residual level moved ITL p99/p50 from 2.14 to 2.06 and TTFT p50 from 2.03x
to 1.95x at 50% load, and from 2.00 to 1.98 and 1.72x to 1.70x at 80% (`--no-level` holds it at rest).

`--workload gpu-mix` / `gpu-base` replays the GPU serving benchmark's workload instead (benchmarks/serving.py: the
base model and 32 adapters in turn, or the base alone; prompts of 320-2,560 tokens), to be used with step costs
fitted to a GPU step trace: `--coef h200-mix`, `h200-base` (the H200 trace of 2026-11-27; with `--noise 0.08
--drift 0.08` and `0.03` it reproduces the measured saturation rates and the base model's latencies, docs/scheduling.md
"The 32-adapter mix on the H200, in simulation"), `h200-mix-fixed` (the mix without the host wait fixed since),
`h200-mix-27c`, `h200-base-27c` (the run after that fix; with `--warm-workload gpu-base --warm-requests 96`, as
serving.py orders its workloads, it gave the mix's measured ITL p99/p50 at 80% load, 5.07 against 5.0).

    python benchmarks/scheduler_sim.py [--budgets-ms auto,0,150] [--loads 0.5,0.8] [--seeds 3]
    python benchmarks/scheduler_sim.py --workload gpu-mix --coef h200-mix --noise 0.08 --drift 0.08 --num-requests 64
    python benchmarks/scheduler_sim.py --workload gpu-mix --coef h200-mix-27d --noise 0.07 --drift 0.03 --loads "" \
        --rates 4.37,6.99 --num-requests 96 --seeds 4 --budgets-ms auto
"""
from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.config import SchedulerConfig   # noqa: E402
from core.engine.request import Request, RequestStatus   # noqa: E402
from core.kv.kv_cache_manager import KVCacheManager   # noqa: E402
from core.sampling.params import SamplingParams   # noqa: E402
from core.scheduling import step_budget, step_time   # noqa: E402
from core.scheduling.scheduler import Scheduler   # noqa: E402
from core.scheduling.step_time import ResidualLevel   # noqa: E402

DEFAULT_COEF = (0.01582, 5.557e-4, 7.138e-4, 1.423e-7, 6.757e-5, 0.0, 0.001003, 0.002734)
# the same fit to the H200's serving trace (results/gpu_run_h200_2026-11-27/serving.steps.jsonl, mixed-step graphs):
# the 32-adapter mix's three rates (mean error 0.079) and the base model's 50% load (0.018). The mix's 7 ms a step for
# carrying prefill with adapters (the base pays 0.8 ms) is most likely the LM head's read-back of its rows, fixed
# since (adapters/layers/context.py): `H200_MIX_FIXED_COEF` is the mix with the base's one-off cost instead
H200_MIX_COEF = (0.007287, 2.141e-05, 2.754e-05, 9.85e-10, 1.279e-05, 0.0, 0.006956, 0.0003862)
H200_MIX_FIXED_COEF = (0.007287, 2.141e-05, 2.754e-05, 9.85e-10, 1.279e-05, 0.0008195, 0.0, 0.0003862)
H200_BASE_COEF = (0.005199, 1.612e-05, 9.068e-05, 3.947e-10, 0.0, 0.0008195, 0.0, 0.0)
# the same fit to the next H200 run's trace (results/gpu_run_h200_2026-11-27c/serving.steps.jsonl: the host-wait fix
# in), all three rates of each workload: the mix (mean error 0.063) and the base model (0.026)
H200_MIX_27C_COEF = (0.007533, 2.193e-05, 0.0, 0.0, 1.201e-05, 0.0, 0.0006154, 0.0004774)
H200_BASE_27C_COEF = (0.005147, 1.933e-05, 8.887e-05, 9.549e-10, 0.0, 0.0, 0.0, 0.0)
# ... and to the run after the tile-aware BGMV configs (results/gpu_run_h200_2026-11-27d/serving.steps.jsonl, all three
# rates of each workload, weighted by 1 / measured time): the mix (mean error 0.038, log residual sd 0.073) and the base
# model (0.027, 0.045); with `--noise 0.07 --drift 0.03` and `0.045 --drift 0.02` at the measured rates they give that
# run's TTFT and ITL within ~20% (docs/scheduling.md, "The H200 run of 2026-11-27d")
H200_MIX_27D_COEF = (0.007875, 1.983e-05, 5.148e-05, 5.782e-10, 1.269e-05, 0.0, 0.0, 0.000288)
H200_BASE_27D_COEF = (0.005154, 1.882e-05, 8.899e-05, 1.094e-09, 0.0, 0.0, 0.0, 0.0)
NAMED_COEF = {"cpu": DEFAULT_COEF, "h200-mix": H200_MIX_COEF, "h200-mix-fixed": H200_MIX_FIXED_COEF,
              "h200-base": H200_BASE_COEF, "h200-mix-27c": H200_MIX_27C_COEF, "h200-base-27c": H200_BASE_27C_COEF,
              "h200-mix-27d": H200_MIX_27D_COEF, "h200-base-27d": H200_BASE_27D_COEF}
SYSTEM_LEN = 32
VOCAB = 4096


@dataclass
class Workload:
    arrivals: list[float]
    prompts: list[list[int]]
    max_tokens: list[int]
    loras: list[object]


@dataclass(frozen=True)
class Shape:
    """A workload's request shape: latency_slo.py's by default (three adapters on 3 of 4 requests), or the GPU
    benchmark's 32-adapter mix (`GPU_MIX`: benchmarks/serving.py's lengths in Llama-3 tokens, the base model and 32
    adapters in turn)."""

    prompt_len: tuple[int, int] = (64, 1024)
    output_len: tuple[int, int] = (32, 256)
    num_adapters: int = 3           # requests go to the base model and these adapters in turn
    system_len: int = SYSTEM_LEN


# serving.py's mix: prompts of 128-1024 words (~2.5 Llama-3 tokens a word in the dummy's 2,048-token vocabulary:
# 1,374-1,620 tokens on average in the H200 runs), outputs of 64-256 tokens, 4 system prompts of 64 words
GPU_MIX = Shape(prompt_len=(320, 2560), output_len=(64, 256), num_adapters=32, system_len=160)
GPU_BASE = Shape(prompt_len=(320, 2560), output_len=(64, 256), num_adapters=0, system_len=160)
SHAPES = {"cpu": Shape(), "gpu-mix": GPU_MIX, "gpu-base": GPU_BASE}


def make_workload(num: int, rate: float, seed: int, shape: Shape = Shape()) -> Workload:
    """`num` requests as latency_slo.py draws them (or `shape`'s); Poisson arrivals at `rate` req/s (inf: all at
    once)."""
    rng = random.Random(seed)
    systems = [[random.Random(f"system-{k}").randrange(200, VOCAB) for _ in range(shape.system_len)]
               for k in range(4)]
    arrivals, prompts, max_tokens, loras = [], [], [], []
    t = 0.0
    for i in range(num):
        n = rng.randint(*shape.prompt_len)
        prompts.append(systems[i % 4] + [rng.randrange(200, VOCAB) for _ in range(max(1, n - shape.system_len))])
        max_tokens.append(rng.randint(*shape.output_len))
        model = i % (1 + shape.num_adapters)
        loras.append(None if model == 0 else f"tenant-{model}")
        arrivals.append(t)
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    return Workload(arrivals, prompts, max_tokens, loras)


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    makespan: float = 0.0
    num_steps: int = 0

    def pct(self, values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else 0.0

    @property
    def tok_s(self) -> float:
        return self.num_output_tokens / self.makespan

    def row(self) -> str:
        p50, p99 = self.pct(self.gaps, 50), self.pct(self.gaps, 99)
        return (f"TTFT p50/p99 {1e3 * self.pct(self.ttft, 50):6.0f}/{1e3 * self.pct(self.ttft, 99):6.0f} ms  "
                f"ITL p50/p99 {1e3 * p50:4.0f}/{1e3 * p99:4.0f} ms ({p99 / p50:4.2f})  {self.tok_s:5.1f} tok/s  "
                f"{self.num_steps} steps")


class Machine:
    """Each step's time factor: exp(drift + noise), where `noise` is the step's own (independent, sigma `noise`) and
    `drift` a slow AR(1) process (stationary sigma `drift`, correlation `drift_corr` from one step to the next):
    a shared machine's speed, which runs above or below its mean for stretches of steps."""

    def __init__(self, noise: float, seed: int, drift: float = 0.0, drift_corr: float = 0.0) -> None:
        assert noise >= 0.0 and drift >= 0.0 and 0.0 <= drift_corr < 1.0, (noise, drift, drift_corr)
        self.rng = np.random.default_rng(seed)
        self.noise, self.drift, self.drift_corr = noise, drift, drift_corr
        self._level = 0.0

    def factor(self) -> float:
        if self.drift > 0.0:      # (no draw without a drift: the noise stream of runs without one stays as it was)
            self._level = self.drift_corr * self._level + self.drift * np.sqrt(1.0 - self.drift_corr ** 2) * \
                self.rng.normal()
        return float(np.exp(self._level + self.rng.normal(0.0, self.noise)))


def simulate(work: Workload, max_step_ms: float | None, coef: np.ndarray, noise: float, seed: int,
             max_num_batched_tokens: int = 2048, num_blocks: int = 16384, block_size: int = 16,
             drift: float = 0.0, drift_corr: float = 0.0, level: bool = True, shape: Shape = Shape(),
             max_loras: int = 4, warm_shape: Shape | None = None, num_warm: int = 12) -> Result:
    """`work` on a fresh scheduler warmed up as latency_slo.py warms its servers (12 requests at once, so the
    step-time model is fitted before the measured requests arrive), or on one that first served `num_warm`
    requests of `warm_shape` at once (serving.py's order: the base model's workload, then the mix's, on one
    server); `level=False` holds the step-time model's residual level at rest (the fit alone)."""
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=max_num_batched_tokens,
                                      max_step_ms=max_step_ms), kv, max_model_len=4096, max_loras=max_loras)
    if not level:
        sched.step_time.level = ResidualLevel(gains=(0.0,))
    machine = Machine(noise, seed, drift, drift_corr)
    run(sched, make_workload(num_warm, float("inf"), 10_000, warm_shape or shape), coef, machine, "w")
    return run(sched, work, coef, machine, "r")


def run(sched: Scheduler, work: Workload, coef: np.ndarray, machine: Machine, prefix: str) -> Result:
    arrived: dict[str, float] = {}
    last: dict[str, float] = {}
    queue = [(a, i) for i, a in enumerate(work.arrivals)]
    heapq.heapify(queue)
    res = Result()
    now = 0.0
    while queue or sched.has_unfinished():
        while queue and queue[0][0] <= now:
            _, i = heapq.heappop(queue)
            rid = f"{prefix}{i}"
            sched.add_request(Request(request_id=rid, prompt_token_ids=list(work.prompts[i]),
                                      sampling_params=SamplingParams(max_tokens=work.max_tokens[i]),
                                      max_tokens=work.max_tokens[i], seed=0, eos_token_ids=frozenset(),
                                      lora_slot_key=work.loras[i]))
            arrived[rid] = work.arrivals[i]
        if not sched.has_unfinished():
            now = queue[0][0]
            continue
        out = sched.schedule()
        assert not out.empty, "a step with nothing scheduled while requests are unfinished"
        seconds = float(out.features.vector() @ coef) * machine.factor()
        sched.observe_step(out, seconds)
        now += seconds
        res.num_steps += 1
        sched.update_after_step(out)
        for req, _ in out.scheduled:
            if req.num_computed_tokens != req.num_tokens:
                continue
            req.append_token(7)
            rid = req.request_id
            if rid in last:
                res.gaps.append(now - last[rid])
            else:
                res.ttft.append(now - arrived[rid])
            last[rid] = now
            res.num_output_tokens += 1
            if req.num_output_tokens >= req.max_tokens:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
    res.makespan = now - min(work.arrivals)
    return res


def budget_arg(text: str) -> float | None:
    return None if text == "auto" else float(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coef", default="cpu", help=f"seconds per feature, comma-separated, or one of {list(NAMED_COEF)}")
    ap.add_argument("--noise", type=float, default=0.16, help="log-normal sigma of each step's time")
    ap.add_argument("--drift", type=float, default=0.0,
                    help="stationary sigma of the machine's slow drift (log), on top of --noise")
    ap.add_argument("--drift-corr", type=float, default=0.93, help="the drift's correlation from one step to the next")
    ap.add_argument("--no-level", action="store_true", help="hold the step-time model's residual level at rest")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--workload", choices=tuple(SHAPES), default="cpu",
                    help="cpu: latency_slo.py's requests; gpu-mix, gpu-base: serving.py's 32-adapter mix and its base "
                         "workload (use with a --coef fitted to a GPU step trace)")
    ap.add_argument("--loads", default="0.5,0.8", help="comma list of fractions of the simulated saturation rate")
    ap.add_argument("--rates", default="", help="comma list of arrival rates in req/s, after the loads (a measured "
                                                "run's offered rates: the simulated saturation is not the measured one)")
    ap.add_argument("--budgets-ms", default="0,auto", help="comma list: 0 (off), auto, or milliseconds")
    ap.add_argument("--seeds", type=int, default=3, help="workloads per point (figures pooled)")
    ap.add_argument("--auto-factor", type=float, default=step_budget.AUTO_BUDGET_FACTOR,
                    help="the auto budget's factor (step_budget.AUTO_BUDGET_FACTOR)")
    ap.add_argument("--min-chunk", type=int, default=step_budget.MIN_PREFILL_CHUNK,
                    help="prefill tokens a step with decode rows always carries (step_budget.MIN_PREFILL_CHUNK)")
    ap.add_argument("--exempt-steps", type=int, default=step_budget.BUDGET_EXEMPT_STEPS,
                    help="steps of waiting after which the auto budget stops sizing a prefill "
                         "(step_budget.BUDGET_EXEMPT_STEPS; a large value: never)")
    ap.add_argument("--typical-steps", type=int, default=step_time.TYPICAL_GAP_STEPS,
                    help="the last steps whose decode-only ones the auto budget's typical gap is the median over "
                         "(step_time.TYPICAL_GAP_STEPS)")
    ap.add_argument("--warm-workload", choices=tuple(SHAPES), default=None,
                    help="warm the scheduler up on this workload's requests instead of the measured one's (serving.py "
                         "runs the base model's workload before the mix's on one server)")
    ap.add_argument("--warm-requests", type=int, default=12, help="requests of the warm-up, all at once")
    ap.add_argument("--backlog-steps", type=int, default=step_budget.BACKLOG_STEPS,
                    help="a step with decode rows carries at least the prefill backlog / this many tokens "
                         "(step_budget.BACKLOG_STEPS; a large value: only the minimum chunk)")
    ap.add_argument("--lift-steps", type=int, default=step_budget.LIFT_STEPS,
                    help="a prefill backlog of more than this many steps' worth at the budget's pace lifts the auto "
                         "budget (step_budget.LIFT_STEPS)")
    args = ap.parse_args()
    # the policy's constants, for this process only: a sweep over them tries a policy before latency_slo.py does
    step_budget.AUTO_BUDGET_FACTOR = args.auto_factor
    step_budget.MIN_PREFILL_CHUNK = args.min_chunk
    step_budget.BUDGET_EXEMPT_STEPS = args.exempt_steps
    step_budget.BACKLOG_STEPS = args.backlog_steps
    step_budget.LIFT_STEPS = args.lift_steps
    step_time.TYPICAL_GAP_STEPS = args.typical_steps
    coef = np.array(NAMED_COEF.get(args.coef) or [float(x) for x in args.coef.split(",")])
    coef = np.pad(coef, (0, max(0, len(DEFAULT_COEF) - len(coef))))     # older fits: no one-off prefill cost, no adapter term
    budgets = [budget_arg(b) for b in args.budgets_ms.split(",")]
    shape = SHAPES[args.workload]
    warm_shape = SHAPES[args.warm_workload] if args.warm_workload else None
    # the warm-up's steps are priced with --coef too (a base-model warm-up under a mix fit pays the mix's fixed cost)
    max_loras = max(4, shape.num_adapters, warm_shape.num_adapters if warm_shape else 0)

    def pooled(rate: float, budget: float | None) -> Result:
        total = Result()
        for s in range(args.seeds):
            r = simulate(make_workload(args.num_requests, rate, 1 + s, shape), budget, coef, args.noise, s,
                         drift=args.drift, drift_corr=args.drift_corr, level=not args.no_level, shape=shape,
                         max_loras=max_loras, warm_shape=warm_shape, num_warm=args.warm_requests)
            total.ttft += r.ttft
            total.gaps += r.gaps
            total.num_output_tokens += r.num_output_tokens
            total.makespan += r.makespan
            total.num_steps += r.num_steps
        return total

    sat = {b: pooled(float("inf"), b) for b in budgets}
    sat_rate = args.seeds * args.num_requests / sat[0.0 if 0.0 in sat else budgets[0]].makespan
    print(f"saturation rate {sat_rate:.3f} req/s")
    for b, r in sat.items():
        print(f"  saturation  budget {b if b is not None else 'auto'!s:>5}: {r.row()}")
    for load in (float(x) for x in args.loads.split(",") if x):
        for b in budgets:
            r = pooled(load * sat_rate, b)
            print(f"  load {load:.1f}    budget {b if b is not None else 'auto'!s:>5}: {r.row()}")
    for rate in (float(x) for x in args.rates.split(",") if x):
        for b in budgets:
            r = pooled(rate, b)
            print(f"  {rate:.2f} req/s budget {b if b is not None else 'auto'!s:>5}: {r.row()}")


if __name__ == "__main__":
    main()
