"""The engine state /metrics and /health report, as one snapshot (read in the engine's own process)."""
from __future__ import annotations

from typing import Any, Iterable

from core.engine.stats import adapter_names
from core.engine_core.protocol import AdapterStats, SpecStats, Stats
from core.startup.kernel_compiles import COMPILES


def _copy(items: Iterable[Any]) -> list[Any]:
    """A copy of a queue another thread may be mutating (retried if it changed under us)."""
    for _ in range(5):
        try:
            return list(items)
        except RuntimeError:
            continue
    return []


def snapshot_stats(engine: Any, held: Iterable[Any] = ()) -> Stats:
    """`held`: requests that arrived and wait outside the scheduler (each with a `lora_slot_key`): counted waiting."""
    sched, kv, stats = engine.scheduler, engine.kv, engine.stats
    running, waiting = _copy(sched.running), _copy(sched.waiting) + list(held)
    return Stats(num_running=len(running), num_waiting=len(waiting), kv_usage=float(kv.usage()),
                 block_size=kv.block_size, num_blocks=kv.num_blocks, num_prompt_tokens=stats.num_prompt_tokens,
                 num_generation_tokens=stats.num_generation_tokens,
                 num_prefix_queries_tokens=kv.num_prefix_queries_tokens, num_prefix_hit_tokens=kv.num_prefix_hit_tokens,
                 num_preemptions=sched.num_preemptions, num_kernel_compiles_after_warmup=COMPILES.after_warmup,
                 running_adapters=adapter_names(running), waiting_adapters=adapter_names(waiting),
                 adapters=_adapter_stats(engine), spec=_spec_stats(stats),
                 step_time_predicted_s=sched.step_time.last_predicted_s,
                 step_time_error_ratio=sched.step_time.error_ratio, step_budget_s=sched.last_budget_s)


def _spec_stats(stats: Any) -> SpecStats | None:
    spec = getattr(stats, "spec", None)
    if spec is None:
        return None
    return SpecStats(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                     list(spec.accepted_per_position), float(spec.mean_acceptance_length))


def _adapter_stats(engine: Any) -> AdapterStats | None:
    registry, pool = getattr(engine, "registry", None), getattr(engine, "lora_pool", None)
    if registry is None or pool is None:
        return None
    by_outcome, buckets, total_s = registry.stats.snapshot()
    return AdapterStats(dict(by_outcome), [(str(b), int(n)) for b, n in buckets], float(total_s),
                        registry.num_host, len(pool.loaded_ids), pool.num_slot_writes)
