"""Engine-side statistics (plain counters and latency samples); the gateway exports them to Prometheus."""
from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field
from typing import Any

# bucket bounds (seconds) of the latency histograms, vLLM's: the gateway's /metrics and `LLM.get_metrics()` share them
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0)


class LatencyHistogram:
    """A Prometheus-style histogram kept by the engine for `LLM.get_metrics()` (every observation counted, unlike
    the bounded sample lists)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)   # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1   # `le`: a value equal to a bound is in it
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> dict[str, int]:
        """{"le": observations <= le}, as Prometheus' `_bucket` samples (the last key "+Inf")."""
        out, total = {}, 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts):
            total += n
            out[bound] = total
        return out


@dataclass
class EngineStats:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    num_batched_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    max_samples: int = 10000
    spec: Any = None             # core.spec.stats.SpecStats when speculative decoding is on
    ttft: LatencyHistogram = field(default_factory=lambda: LatencyHistogram(TTFT_BUCKETS))
    itl: LatencyHistogram = field(default_factory=lambda: LatencyHistogram(ITL_BUCKETS))
    e2e: LatencyHistogram = field(default_factory=lambda: LatencyHistogram(E2E_BUCKETS))
    num_finished: dict[str, int] = field(default_factory=dict)   # finished requests by finish reason

    def record_step(self, num_tokens: int, num_reqs: int) -> None:
        self.num_steps += 1
        self.num_batched_tokens += num_tokens

    def observe_ttft(self, seconds: float) -> None:
        with self.lock:
            self.ttft_s.append(seconds)
            del self.ttft_s[:-self.max_samples]
            self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        with self.lock:
            self.itl.observe(seconds)

    def observe_e2e(self, seconds: float, finish_reason: str | None = None) -> None:
        with self.lock:
            self.e2e_s.append(seconds)
            del self.e2e_s[:-self.max_samples]
            self.e2e.observe(seconds)
            if finish_reason is not None:
                self.num_finished[finish_reason] = self.num_finished.get(finish_reason, 0) + 1


def adapter_names(requests: Any) -> str:
    """The adapters of `requests`, comma-separated and sorted (`/metrics`' `lora_requests_info` labels)."""
    return ",".join(sorted({r.lora_slot_key.name for r in requests if getattr(r, "lora_slot_key", None) is not None}))


# ---- the offline API's metrics (`LLM.get_metrics()`, the shape of vLLM's `vllm.v1.metrics.reader`) -------
@dataclass
class Metric:
    name: str                                   # the Prometheus name without `_total`
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    values: list[int] = field(default_factory=list)


@dataclass
class Histogram(Metric):
    count: int = 0
    sum: float = 0.0
    buckets: dict[str, int] = field(default_factory=dict)   # cumulative, by upper bound ("+Inf" last)


def engine_metrics(engine: Any) -> list[Metric]:
    """Counters, gauges and latency histograms of an engine, named and labelled as `/metrics` names them
    (`loraplex:` prefix): the info gauges too (`cache_config_info` 1.0, `lora_requests_info` the time of reading, as
    vLLM's); `request_success` by finish reason; TTFT / inter-token / end-to-end latency as `Histogram`s (vLLM's
    reader: `count`, `sum`, cumulative `buckets` by upper bound)."""
    stats, sched, kv = engine.stats, engine.scheduler, engine.kv
    out: list[Metric] = [
        Gauge("loraplex:num_requests_running", value=sched.num_running),
        Gauge("loraplex:num_requests_waiting", value=sched.num_waiting),
        Gauge("loraplex:kv_cache_usage_perc", value=kv.usage()),
        Gauge("loraplex:cache_config_info", labels={"block_size": str(kv.block_size),
                                                    "num_gpu_blocks": str(kv.num_blocks)}, value=1.0),
        Gauge("loraplex:lora_requests_info", value=time.time(), labels={
            "max_lora": str(engine.config.lora.max_loras), "running_lora_adapters": adapter_names(sched.running),
            "waiting_lora_adapters": adapter_names(sched.waiting)}),
        Counter("loraplex:prompt_tokens", value=stats.num_prompt_tokens),
        Counter("loraplex:generation_tokens", value=stats.num_generation_tokens),
        Counter("loraplex:prefix_cache_queries", value=kv.num_prefix_queries_tokens),
        Counter("loraplex:prefix_cache_hits", value=kv.num_prefix_hit_tokens),
        Counter("loraplex:num_preemptions", value=sched.num_preemptions),
        Gauge("loraplex:step_time_predicted_seconds", value=sched.step_time.last_predicted_s),
        Gauge("loraplex:step_time_prediction_error_ratio", value=sched.step_time.error_ratio),
        Gauge("loraplex:step_time_budget_seconds", value=sched.last_budget_s),
    ]
    with stats.lock:
        out += [Counter("loraplex:request_success", labels={"finished_reason": reason}, value=n)
                for reason, n in sorted(stats.num_finished.items())]
        out += [Histogram(name, count=h.count, sum=h.sum, buckets=h.cumulative())
                for name, h in (("loraplex:time_to_first_token_seconds", stats.ttft),
                                ("loraplex:inter_token_latency_seconds", stats.itl),
                                ("loraplex:e2e_request_latency_seconds", stats.e2e))]
    spec = getattr(stats, "spec", None)
    if spec is not None:
        out += [Counter("loraplex:spec_decode_num_drafts", value=spec.num_drafts),
                Counter("loraplex:spec_decode_num_draft_tokens", value=spec.num_draft_tokens),
                Counter("loraplex:spec_decode_num_accepted_tokens", value=spec.num_accepted_tokens),
                Vector("loraplex:spec_decode_num_accepted_tokens_per_pos", values=list(spec.accepted_per_position)),
                Gauge("loraplex:spec_decode_mean_acceptance_length", value=spec.mean_acceptance_length)]
    return out
