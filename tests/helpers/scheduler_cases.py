"""The scheduler alone, as its tests drive it: requests over a small vocabulary, a scheduler over a fresh block
pool, and one step's bookkeeping as the engine does it (a token for every request whose prompt is computed,
`check_integrity()` after every step)."""
from __future__ import annotations

from core.config import SchedulerConfig
from core.engine.request import Request, RequestStatus
from core.kv.kv_cache_manager import KVCacheManager
from core.sampling.params import SamplingParams
from core.scheduling.scheduler import Scheduler, SchedulerOutput

BS = 4


def make_request(rid: str, num_prompt: int, max_tokens: int, start: int = 0, lora: object = None,
                 priority: int = 0) -> Request:
    tokens = [(start + i) % 50 for i in range(num_prompt)]
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=max_tokens),
                   max_tokens=max_tokens, seed=0, eos_token_ids=frozenset(), lora_slot_key=lora, priority=priority)


def make_scheduler(budget: int, num_blocks: int, max_num_seqs: int, max_loras: int = 8, policy: str = "fcfs",
                   caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy,
                                     max_step_ms=0.0), kv, max_model_len=4096, max_loras=max_loras)


def advance(sched: Scheduler, out: SchedulerOutput) -> None:
    sched.update_after_step(out)
    for req, _ in out.scheduled:
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(7)
            if req.num_output_tokens >= req.max_tokens:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
    sched.check_integrity()
