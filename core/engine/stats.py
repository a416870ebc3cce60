"""Engine-side statistics (plain counters and latency samples); the gateway exports them to Prometheus."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any


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

    def record_step(self, num_tokens: int, num_reqs: int) -> None:
        self.num_steps += 1
        self.num_batched_tokens += num_tokens

    def observe_ttft(self, seconds: float) -> None:
        with self.lock:
            self.ttft_s.append(seconds)
            del self.ttft_s[:-self.max_samples]

    def observe_e2e(self, seconds: float) -> None:
        with self.lock:
            self.e2e_s.append(seconds)
            del self.e2e_s[:-self.max_samples]


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


def engine_metrics(engine: Any) -> list[Metric]:
    """Counters and gauges of an engine, named and labelled as `/metrics` names them (`loraplex:` prefix): the
    info gauges too (`cache_config_info` 1.0, `lora_requests_info` the time of reading, as vLLM's)."""
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
    spec = getattr(stats, "spec", None)
    if spec is not None:
        out += [Counter("loraplex:spec_decode_num_drafts", value=spec.num_drafts),
                Counter("loraplex:spec_decode_num_draft_tokens", value=spec.num_draft_tokens),
                Counter("loraplex:spec_decode_num_accepted_tokens", value=spec.num_accepted_tokens),
                Vector("loraplex:spec_decode_num_accepted_tokens_per_pos", values=list(spec.accepted_per_position)),
                Gauge("loraplex:spec_decode_mean_acceptance_length", value=spec.mean_acceptance_length)]
    return out
