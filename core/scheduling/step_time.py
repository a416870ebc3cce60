"""An online model of one engine step's wall time, fitted from the steps the engine runs.

    seconds ~= c0 + c1 * prefill tokens + c2 * decode tokens + c3 * attention context + c4 * LoRA tokens
               + c5 * [the step carries prefill] + c6 * [the step carries prefill and LoRA rows] + c7 * adapters

- prefill tokens: the query tokens of rows that compute prompt (or recompute) positions;
- decode tokens: the query tokens of rows that compute their last sampled token (and its drafts, if any);
- attention context: sum over rows of query tokens x the row's context length after the step (the query-key
  pairs the attention reads: a decode row's KV length, a prefill chunk's n x (done + n));
- LoRA tokens: the query tokens of rows served through an adapter;
- adapters: the distinct adapters among the step's rows. Each costs its own small matmuls in every wrapped linear
  whatever its number of tokens: on the CPU, 7 ms a step per adapter on latency_slo.py's 8-layer model (decode
  steps of 8 rows: 15 ms base, 22.5 ms with one adapter, 36 ms with three), the largest term a LoRA-token count
  cannot express;
- the two indicators: what a step pays once for carrying any prefill. On a GPU a decode-only step replays a CUDA
  graph and a step with a prefill chunk runs eagerly (every kernel launched from Python, the LoRA path's
  segmented kernels and metadata too), a jump that a per-token term cannot express; on the CPU, where every step
  runs eagerly, they fit near zero. `prefill_overhead` reads them.

The coefficients are a non-negative least-squares fit of the relative error (Lawson-Hanson on the normal
equations, with column scaling and a small ridge) over the last `window` steps, refitted every `refit_every` steps, so
the model follows the machine (a GPU clocking down, other tenants on the CPU). Steps that carry prefill and
decode-only steps keep a window each (`window` // 2 steps): a long stretch of decode-only steps would otherwise
push every prefill out of the window, the prefill-token coefficient would fit to zero, and the next prompt's
chunk would be sized as if its tokens were free (measured on latency_slo.py: a 929-token chunk predicted at
22 ms under a 28 ms budget ran 660 ms). Each step's prediction, made
before the step with the coefficients then in force, is compared with the measured time: the mean absolute
relative error over the window is the model's error, exported with its last prediction to /metrics
(`loraplex:step_time_predicted_seconds`, `loraplex:step_time_prediction_error_ratio`).

The fit's residual is not noise alone: on a shared machine a step's time runs above or below the fit for stretches
of steps (other processes on the cores, clocks, caches), and one step's residual predicts the next's
(latency_slo.py's step traces on the 2-core CPU: lag-1 correlation of the log residual 0.66, lag 10 0.33). Every
prediction is therefore the fit times a level, an exponentially weighted mean of the recent log residuals
(`ResidualLevel`), whose gain is chosen online among `LEVEL_GAINS` by its own error on the steps since: 0 (no
correction) where the residuals are independent, up to 0.5 where the machine drifts. Replayed on those traces
(benchmarks/step_time_replay.py, results/step_time_replay_cpu.md): the mean error fell from 0.077 to 0.053, and the
97th percentile of a budget-sized step's measured over predicted time from 1.26 to 1.19, the margin the inter-token
tail needs (benchmarks/README.md, "Latency under load").

The scheduler (core/scheduling/step_budget.py) asks it how many prefill tokens fit a step-time budget.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

NUM_FEATURES = 8        # (1, prefill tokens, decode tokens, attention context, LoRA tokens, prefill?, prefill with LoRA?,
                        #  adapters)
_RIDGE = 1e-6           # relative to the scaled normal matrix's diagonal
LEVEL_GAINS = (0.0, 0.1, 0.2, 0.3, 0.5)   # the residual level's candidate gains (0: no correction)
LEVEL_MEMORY = 0.99     # per step, the decay of each candidate's mean squared one-step-ahead error
LEVEL_CLIP = 1.0        # a step's log residual is clipped to +-this before it moves the level (an outlier: e^1 x)
TYPICAL_GAP_STEPS = 128  # the decode-only steps among the last this many steps observed: `typical_decode_s`'s
                         # sample (the auto budget's yardstick) ...
TYPICAL_GAP_MIN_STEPS = 4  # ... when it holds at least this many (fewer: one outlier, a pause, would set the budget)


@dataclass(frozen=True)
class StepFeatures:
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_context_tokens: int = 0
    num_lora_tokens: int = 0
    num_lora_groups: int = 0        # distinct adapters among the rows

    def vector(self) -> np.ndarray:
        prefill = 1.0 if self.num_prefill_tokens > 0 else 0.0
        return np.array([1.0, self.num_prefill_tokens, self.num_decode_tokens, self.num_context_tokens,
                         self.num_lora_tokens, prefill, prefill if self.num_lora_tokens > 0 else 0.0,
                         self.num_lora_groups], dtype=np.float64)

    def plus_row(self, num_new: int, context_len: int, decode: bool, lora: bool,
                 new_adapter: bool = False) -> "StepFeatures":
        """These features with one more row of `num_new` query tokens whose context is `context_len` after it
        (`new_adapter`: its adapter has no other row in the step)."""
        return StepFeatures(self.num_prefill_tokens + (0 if decode else num_new),
                            self.num_decode_tokens + (num_new if decode else 0),
                            self.num_context_tokens + num_new * context_len,
                            self.num_lora_tokens + (num_new if lora else 0),
                            self.num_lora_groups + (1 if lora and new_adapter else 0))

    @property
    def empty(self) -> bool:
        return self.num_prefill_tokens == 0 and self.num_decode_tokens == 0


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin_{x >= 0} x'Ax/2 - b'x for a symmetric positive definite `a` (the normal equations of a
    least-squares fit): Lawson and Hanson's active-set method, exact in at most a few passes for a few features."""
    n = len(b)
    tol = 1e-12 * max(float(np.abs(b).max()), 1e-300)
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    for _ in range(3 * n):
        w = b - a @ x                             # the negative gradient
        candidates = ~passive & (w > tol)
        if not candidates.any():
            break
        passive[int(np.argmax(np.where(candidates, w, -np.inf)))] = True
        for _ in range(3 * n):
            z = np.zeros(n)
            z[passive] = np.linalg.solve(a[np.ix_(passive, passive)], b[passive])
            if np.all(z[passive] > 0):
                x = z
                break
            neg = passive & (z <= 0)
            alpha = float(np.min(x[neg] / (x[neg] - z[neg])))
            x = x + alpha * (z - x)
            passive &= x > 0
            x[~passive] = 0.0
    return x


class ResidualLevel:
    """The recent log residual of the step-time fit, log(measured / fitted), as an exponentially weighted mean with
    the gain (among `LEVEL_GAINS`) whose predictions of the residual erred least lately. A candidate is scored on
    what it predicted when the step was scheduled (`snapshot()` then, handed back to `observe`): with async
    scheduling a step is scheduled before the one ahead of it is observed, so the level in force is two steps old,
    and a gain that only predicts one step ahead well would be chosen for the wrong horizon. Residuals are clipped
    to +-`LEVEL_CLIP` for the scores as for the levels: one stalled step must not decide the gain for the next
    hundreds."""

    def __init__(self, gains: tuple[float, ...] = LEVEL_GAINS) -> None:
        assert gains and all(0.0 <= g <= 1.0 for g in gains)
        self._gains = np.array(gains)
        self._levels = np.zeros(len(gains))      # [G] each candidate gain's level
        self._errors = np.zeros(len(gains))      # [G] its decayed mean squared one-step error
        self._best = 0                                 # index of the gain in force (0: no correction)
        self._scale = 1.0                              # exp(the level in force), kept: predict() runs per chunk size

    @property
    def scale(self) -> float:
        """What the fit's prediction is multiplied by: exp(the level in force)."""
        return self._scale

    @property
    def gain(self) -> float:
        return float(self._gains[self._best])

    def snapshot(self) -> tuple[float, ...]:
        """Every candidate's level now: what each predicts for the step being scheduled."""
        return tuple(float(v) for v in self._levels)

    def observe(self, log_residual: float, scheduled: tuple[float, ...] = ()) -> None:
        """A step's log residual; `scheduled`: the `snapshot()` taken when that step was scheduled (default: the
        levels now, as when each step is observed before the next is scheduled)."""
        if not np.isfinite(log_residual):
            return
        clipped = min(max(log_residual, -LEVEL_CLIP), LEVEL_CLIP)
        predicted = np.array(scheduled) if len(scheduled) == len(self._levels) else self._levels     # [G]
        self._errors = LEVEL_MEMORY * self._errors + (1.0 - LEVEL_MEMORY) * (clipped - predicted) ** 2
        self._levels += self._gains * (clipped - self._levels)
        self._best = int(np.argmin(self._errors))       # ties: the smallest gain
        self._scale = float(np.exp(self._levels[self._best]))

    def check_integrity(self) -> None:
        assert np.all(np.isfinite(self._levels)) and np.all(np.abs(self._levels) <= LEVEL_CLIP + 1e-12)
        assert self._levels[self._gains == 0.0].tolist() == [0.0] * int((self._gains == 0.0).sum()), \
            "a level moved with gain 0"
        assert np.all(self._errors >= 0.0) and np.all(np.isfinite(self._errors)), "a bad level error"
        assert 0 <= self._best < len(self._gains) and self._errors[self._best] == self._errors.min()
        assert self._scale == float(np.exp(self._levels[self._best])), "a stale scale"


class StepTimeModel:
    def __init__(self, window: int = 256, refit_every: int = 4, min_observations: int = 16) -> None:
        assert window >= min_observations >= NUM_FEATURES
        self.window = window
        self.refit_every = refit_every
        self.min_observations = min_observations
        # (features, seconds) of the last steps: those that carried prefill, and decode-only ones
        self._prefill_steps: deque[tuple[np.ndarray, float]] = deque(maxlen=window // 2)
        self._decode_steps: deque[tuple[np.ndarray, float]] = deque(maxlen=window - window // 2)
        self._errors: deque[float] = deque(maxlen=window)   # |predicted - measured| / measured, when predicted
        self.coef = np.zeros(NUM_FEATURES)
        self.num_observations = 0
        self.last_predicted_s = 0.0
        self.last_measured_s = 0.0
        self._since_fit = 0
        self._typical_decode_s: float | None = None   # typical_decode_s(), kept until a decode-only step arrives
        # (seconds, decode rows, observation number) of the decode-only steps among the last TYPICAL_GAP_STEPS
        # observed: the typical gap's sample
        self._gaps: deque[tuple[float, int, int]] = deque(maxlen=TYPICAL_GAP_STEPS)
        self.level = ResidualLevel()      # the recent residual of the fit: every prediction is scaled by it

    @property
    def ready(self) -> bool:
        """True once fitted on enough steps, with both prefill and decode tokens among them."""
        return self.num_observations >= self.min_observations and bool(self.coef.any())

    def predict(self, f: StepFeatures) -> float:
        """Predicted seconds of a step with features `f`: the fit times the residual level (0.0 before the model is
        ready)."""
        return self._fitted(f) * self.level.scale

    def prefill_overhead(self, f: StepFeatures) -> float:
        """Predicted seconds a step with features `f` pays once because it carries prefill (the indicator terms:
        on a GPU, leaving the decode graph for an eager step); 0.0 for a step without prefill."""
        v = f.vector()
        return float(v[5:7] @ self.coef[5:7]) * self.level.scale if self.ready else 0.0

    def prefill_work_s(self, f: StepFeatures) -> float:
        """Predicted seconds of the per-token terms of `f` (prefill tokens, attention context, LoRA tokens): what its
        rows cost whatever steps they are spread over, without any step's own costs (0.0 before the model is ready)."""
        v = f.vector()
        return float(v[[1, 3, 4]] @ self.coef[[1, 3, 4]]) * self.level.scale if self.ready else 0.0

    def _fitted(self, f: StepFeatures) -> float:
        """The fit's seconds for `f`, without the residual level (0.0 before the model is ready)."""
        return float(f.vector() @ self.coef) if self.ready else 0.0

    @property
    def num_kept(self) -> int:
        """Steps in the fitting windows."""
        return len(self._prefill_steps) + len(self._decode_steps)

    @property
    def error_ratio(self) -> float:
        """Mean |predicted - measured| / measured over the window's predicted steps (0.0 before any)."""
        return float(np.mean(self._errors)) if self._errors else 0.0

    def typical_decode_s(self) -> float:
        """The typical gap between two tokens of a decoding request when no prefill is in the way: the median over
        the decode rows of the decode-only steps among the last `TYPICAL_GAP_STEPS` steps observed (a step of n rows
        is n gaps, as clients count them) of their measured time; 0.0 when there are fewer than
        `TYPICAL_GAP_MIN_STEPS` (the budget then prices the step's own decode rows). A count of decode-only steps alone went stale when they were rare: on the H200
        (results/gpu_run_h200_2026-11-27c, serving) the 32-adapter mix's first ~600 steps at 50% load, most of them
        carrying prefill, kept the base model's 7 ms steps of the workload before as the yardstick of their 12 ms
        ones, so the budget left room for the minimum chunk only, prompts aged into the exemption, and their
        whole prefills at once made 12 of the 14 worst gaps."""
        if self._typical_decode_s is None:
            self._typical_decode_s = 0.0
            if len(self._gaps) >= TYPICAL_GAP_MIN_STEPS:
                times = np.array([t for t, _, _ in self._gaps])           # [n]
                rows = np.array([n for _, n, _ in self._gaps])            # [n] decode rows
                order = np.argsort(times, kind="stable")
                cum = np.cumsum(rows[order])
                self._typical_decode_s = float(times[order][int(np.searchsorted(cum, 0.5 * cum[-1]))])
        return self._typical_decode_s

    def observe(self, f: StepFeatures, seconds: float, predicted_s: float = 0.0,
                levels: tuple[float, ...] = ()) -> None:
        """One step's features and measured wall time; `predicted_s` and `levels`: the prediction the scheduler made
        for it and the residual level's `snapshot()` then (with async scheduling a step is observed after the next
        one was scheduled: the error reported is the one the scheduler acted on). Without them, the prediction now."""
        if f.empty or not np.isfinite(seconds) or seconds <= 0.0:
            return
        if self.ready:
            predicted = predicted_s if predicted_s > 0.0 else self.predict(f)
            self.last_predicted_s = predicted
            self._errors.append(abs(predicted - seconds) / seconds)
            fitted = self._fitted(f)
            if fitted > 0.0:
                with np.errstate(over="ignore", divide="ignore"):
                    self.level.observe(float(np.log(seconds / fitted)), levels)
        self.last_measured_s = seconds
        (self._prefill_steps if f.num_prefill_tokens else self._decode_steps).append((f.vector(), float(seconds)))
        if not f.num_prefill_tokens:
            self._gaps.append((float(seconds), f.num_decode_tokens, self.num_observations))
            self._typical_decode_s = None        # recomputed on the next ask
        while self._gaps and self._gaps[0][2] <= self.num_observations - TYPICAL_GAP_STEPS:
            self._gaps.popleft()                 # older than the last TYPICAL_GAP_STEPS steps
            self._typical_decode_s = None
        self.num_observations += 1
        self._since_fit += 1
        if self.num_kept >= self.min_observations and (self._since_fit >= self.refit_every or not self.ready):
            self._fit()

    def _fit(self) -> None:
        """Least squares of the relative error (each step weighted by 1 / its time): a decode-only step, the
        auto budget's yardstick, counts as much as a long prefill."""
        steps = [*self._prefill_steps, *self._decode_steps]
        x = np.stack([v for v, _ in steps])       # [n, NUM_FEATURES]
        y = np.array([t for _, t in steps])       # [n]
        scale = np.maximum(np.abs(x).max(axis=0), 1.0)
        xs = x / scale / y[:, None]               # [n, NUM_FEATURES]: columns in [0, 1], rows over their time
        a = xs.T @ xs
        a[np.diag_indices_from(a)] += _RIDGE * max(float(np.trace(a)), 1e-12)
        coef = nnls(a, xs.sum(axis=0)) / scale    # xs' (y / y)
        if np.all(np.isfinite(coef)):
            self.coef = coef
        self._since_fit = 0

    def check_integrity(self) -> None:
        assert self.num_kept <= self.window, "more steps kept than the window"
        assert all(v[1] > 0 for v, _ in self._prefill_steps), "a decode-only step in the prefill window"
        assert all(v[1] == 0 for v, _ in self._decode_steps), "a step with prefill in the decode-only window"
        assert all(v.shape == (NUM_FEATURES,) for v, _ in [*self._prefill_steps, *self._decode_steps])
        assert len(self._errors) <= self.window
        assert self.coef.shape == (NUM_FEATURES,) and np.all(np.isfinite(self.coef)), "a non-finite coefficient"
        assert np.all(self.coef >= 0.0), "a negative step-time coefficient"
        assert all(t > 0.0 for _, t in [*self._prefill_steps, *self._decode_steps]), "a non-positive step time"
        assert all(e >= 0.0 and np.isfinite(e) for e in self._errors), "a bad prediction error"
        assert self.num_observations >= self.num_kept
        assert len(self._gaps) <= (self._gaps.maxlen or 0) and all(t > 0.0 and n > 0 for t, n, _ in self._gaps), \
            "a bad decode-only step in the typical gap's sample"
        assert all(self.num_observations - TYPICAL_GAP_STEPS <= i < self.num_observations for _, _, i in self._gaps), \
            "a decode-only step older than the typical gap's last steps"
        if self._typical_decode_s is not None:
            cached, self._typical_decode_s = self._typical_decode_s, None
            assert self.typical_decode_s() == cached, "a stale typical decode step"
        assert not self.ready or self.num_observations >= self.min_observations
        self.level.check_integrity()
