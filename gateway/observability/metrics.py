"""Prometheus metrics: engine state read at scrape time, plus request latency histograms observed by the gateway."""
from __future__ import annotations

import logging
import time
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from core.engine.interface import ServingEngine
from core.engine.stats import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS
from core.engine_core.protocol import AdapterStats, SpecStats, Stats
from gateway.http.context import ABORT_REASONS, RequestContext

log = logging.getLogger("loraplex.gateway")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# labels whose values name a tenant or an adapter (served model): never on the main port with --tenant-keys
NAME_LABELS = frozenset({"tenant", "model", "adapter", "lora_name", "running_lora_adapters",
                         "waiting_lora_adapters"})


class EngineCollector(Collector):
    """The engine's scheduler, KV pool and counters when Prometheus scrapes: one snapshot (`ServingEngine.stats`),
    read in the engine's process (`core/engine_core/stats.py`): here for an in-process engine, or the engine
    process's report, asked for by the scrape (`GatewayMetrics.render_current`)."""

    def __init__(self, engine: ServingEngine, max_loras: int) -> None:
        self.engine = engine
        self.max_loras = max_loras

    def collect(self) -> Iterator[Metric]:
        st = self.engine.stats()
        if st is None:   # an engine process that has not reported yet
            return
        yield GaugeMetricFamily("loraplex:num_requests_running", "Requests in the running batch.",
                                value=st.num_running)
        yield GaugeMetricFamily("loraplex:num_requests_waiting", "Requests waiting to be scheduled.",
                                value=st.num_waiting)
        yield GaugeMetricFamily("loraplex:kv_cache_usage_perc", "Fraction of KV blocks held by requests (0-1).",
                                value=st.kv_usage)
        info = GaugeMetricFamily("loraplex:cache_config_info", "KV cache configuration.",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(st.block_size), str(st.num_blocks)], 1.0)
        yield info
        lora = GaugeMetricFamily("loraplex:lora_requests_info", "Running and waiting LoRA adapters.",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        lora.add_metric([str(self.max_loras), st.running_adapters, st.waiting_adapters], time.time())
        yield lora
        counters = (
            ("loraplex:prompt_tokens", "Prompt tokens admitted.", st.num_prompt_tokens),
            ("loraplex:generation_tokens", "Tokens generated.", st.num_generation_tokens),
            ("loraplex:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             st.num_prefix_queries_tokens),
            ("loraplex:prefix_cache_hits", "Prompt tokens found in the prefix cache.", st.num_prefix_hit_tokens),
            ("loraplex:num_preemptions", "Requests preempted (recomputed).", st.num_preemptions),
            ("loraplex:kernel_compiles_after_warmup", "Triton JIT compiles after the start-up warm-up (stalls).",
             st.num_kernel_compiles_after_warmup),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        yield from _step_time_metrics(st)
        yield from _adapter_metrics(st.adapters)
        if st.spec is not None:   # speculative decoding counters, when it is on
            yield from _spec_metrics(st.spec)


def _step_time_metrics(st: Stats) -> Iterator[Metric]:
    """The online step-time model (core/scheduling/step_time.py) and the budget it sizes prefill chunks to."""
    yield GaugeMetricFamily("loraplex:step_time_predicted_seconds",
                            "The step-time model's prediction for the last engine step (0 until it is fitted).",
                            value=st.step_time_predicted_s)
    yield GaugeMetricFamily("loraplex:step_time_prediction_error_ratio",
                            "Mean |predicted - measured| / measured step time over the model's recent steps.",
                            value=st.step_time_error_ratio)
    yield GaugeMetricFamily("loraplex:step_time_budget_seconds",
                            "The time budget the last step's prefill chunks were sized to (0: none, e.g. no "
                            "request decoding or --max-step-ms 0).", value=st.step_budget_s)


def _spec_metrics(spec: SpecStats) -> Iterator[Metric]:
    """Speculative decoding (vLLM's names, our prefix): drafts, accepted drafts, acceptance per position."""
    for name, doc, value in (
            ("loraplex:spec_decode_num_drafts", "Verification runs (a request's drafts of one step).", spec.num_drafts),
            ("loraplex:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", spec.num_draft_tokens),
            ("loraplex:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens)):
        yield CounterMetricFamily(name, doc, value=value)
    per_pos = CounterMetricFamily("loraplex:spec_decode_num_accepted_tokens_per_pos",
                                  "Runs that accepted the draft at this position.", labels=["position"])
    for j, value in enumerate(spec.accepted_per_position):
        per_pos.add_metric([str(j)], value)
    yield per_pos
    yield GaugeMetricFamily("loraplex:spec_decode_mean_acceptance_length",
                            "Tokens per verification run: 1 + accepted drafts / runs.", value=spec.mean_acceptance_length)


def _adapter_metrics(st: AdapterStats | None) -> Iterator[Metric]:
    """Adapter loads (by outcome), their latency, and how many adapters are resident on host and device."""
    if st is None:   # an engine without adapters
        return
    loads = CounterMetricFamily("loraplex:lora_adapter_loads", "Adapter weight loads (reads), by outcome.",
                                labels=["outcome"])
    for outcome, n in st.loads_by_outcome.items():
        loads.add_metric([outcome], n)
    yield loads
    latency = HistogramMetricFamily("loraplex:lora_adapter_load_seconds", "Time to read and convert an adapter.",
                                    labels=[])
    latency.add_metric([], st.load_buckets, st.load_seconds_sum)
    yield latency
    yield GaugeMetricFamily("loraplex:lora_adapters_host", "Adapters resident in host memory (or being read).",
                            value=st.num_host)
    yield GaugeMetricFamily("loraplex:lora_adapters_device", "Adapters resident in device LoRA slots.",
                            value=st.num_device)
    yield CounterMetricFamily("loraplex:lora_adapter_device_loads", "Adapter copies from host memory into a device "
                              "LoRA slot (a reload after an eviction counts again).", value=st.num_slot_writes)


class GatewayMetrics:
    """One registry per app (no global state): engine gauges and counters, request latency histograms."""

    def __init__(self, engine: ServingEngine, max_loras: int) -> None:
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine, max_loras))
        self.ttft = Histogram("loraplex:time_to_first_token_seconds", "Time to first token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("loraplex:inter_token_latency_seconds", "Time between output tokens.",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("loraplex:e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=E2E_BUCKETS, registry=self.registry)
        self.requests = Counter("loraplex:request_success", "Finished requests by finish reason.",
                                labelnames=["finished_reason"], registry=self.registry)
        # API requests cut before their end (never in request_success or a tenant's 200s); every reason from the start
        self.aborted = Counter("loraplex:request_aborted", "API requests aborted before their end, by reason: the "
                               "client went away (disconnect), --request-timeout (timeout), the server's shutdown "
                               "(shutdown).", labelnames=["reason"], registry=self.registry)
        for reason in ABORT_REASONS:
            self.aborted.labels(reason=reason)
        self.tenant_requests = Counter("loraplex:tenant_requests", "API requests by tenant, model and HTTP status.",
                                       labelnames=["tenant", "model", "status"], registry=self.registry)
        self.tenant_prompt_tokens = Counter("loraplex:tenant_prompt_tokens", "Prompt tokens admitted, by tenant.",
                                            labelnames=["tenant"], registry=self.registry)
        self.tenant_generation_tokens = Counter("loraplex:tenant_generation_tokens", "Tokens generated, by tenant.",
                                                labelnames=["tenant"], registry=self.registry)

    def observe_abort(self, reason: str) -> None:
        self.aborted.labels(reason=reason).inc()

    def observe_tenant_request(self, ctx: RequestContext) -> None:
        """One finished API request (its caller was authenticated).
        `model` is the served name it resolved to, else "unknown" (client-chosen names never become labels)."""
        tenant = ctx.tenant
        self.tenant_requests.labels(tenant=tenant, model=ctx.model or "unknown",
                                    status=str(ctx.effective_status)).inc()
        if ctx.admitted:
            self.tenant_prompt_tokens.labels(tenant=tenant).inc(ctx.prompt_tokens)
            self.tenant_generation_tokens.labels(tenant=tenant).inc(ctx.completion_tokens)

    async def render_current(self, redact: bool = False) -> bytes:
        """`render` after the engine reported its state as it is now (an engine process: answered between two
        steps, at most `EngineClient.refresh`'s timeout)."""
        await self.engine.refresh()
        return self.render(redact)

    def render(self, redact: bool = False) -> bytes:
        """Prometheus text; `redact`: without any tenant or adapter name (see `TenantBlindView`)."""
        return generate_latest(TenantBlindView(self.registry) if redact else self.registry)


class TenantBlindView:
    """A registry as a tenant may see it: every label in `NAME_LABELS` dropped, the samples that then share
    their remaining labels summed (a counter or histogram keeps its total, `_created` the earliest time;
    `lora_requests_info` keeps only `max_lora`). Families are redacted by label, so a metric added later with one of these labels is too."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if not any(NAME_LABELS.intersection(sample.labels) for sample in family.samples):
                yield family
                continue
            sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
            for sample in family.samples:
                kept = tuple((k, v) for k, v in sample.labels.items() if k not in NAME_LABELS)
                key = (sample.name, kept)
                if key not in sums:
                    sums[key] = sample.value
                elif sample.name.endswith("_created"):   # a series' creation time: the earliest one
                    sums[key] = min(sums[key], sample.value)
                else:
                    sums[key] += sample.value
            blind = Metric(family.name, family.documentation, family.type, family.unit)
            for (name, labels), value in sums.items():
                blind.add_sample(name, dict(labels), value)
            yield blind


class RequestTimer:
    """Latency of one engine request as the gateway sees it."""

    def __init__(self, metrics: GatewayMetrics | None) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.last: float | None = None

    def on_tokens(self, num_tokens: int) -> None:
        if self.metrics is None or num_tokens == 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe((now - self.last) / num_tokens)
        self.last = now

    def on_finish(self, finish_reason: str | None) -> None:
        if self.metrics is None or finish_reason == "abort":   # aborted: loraplex:request_aborted_total, not here
            return
        self.metrics.e2e.observe(time.monotonic() - self.start)
        self.metrics.requests.labels(finished_reason=finish_reason or "error").inc()
