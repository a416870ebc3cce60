"""Messages between the API process and the engine-core process (msgspec structs, msgpack on the wire).

One message per step each way: the API side batches every add, abort and command of one event-loop turn into
one `EngineInput`; the engine sends one `EngineOutput` per step with every request's delta of that step, the
replies to commands and (at most every `STATS_INTERVAL_S`) a stats snapshot for /metrics and /health.
Plain deltas (token ids, text, counters) are msgpack arrays; the rare rich parts (logprobs, an error's
exception, `SamplingParams`, grammar handles, command arguments) travel as pickles inside the message.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from core.engine.outputs import RequestDelta

if TYPE_CHECKING:   # core.engine.interface reads `Stats` from here
    from core.engine.interface import EngineFacts

STATS_INTERVAL_S = 0.05     # seconds between stats snapshots while busy (idle: every heartbeat)
HEARTBEAT_S = 0.5           # an idle engine still reports this often


class AddRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: bytes            # pickled SamplingParams
    kwargs: bytes | None     # pickled engine keyword arguments (tenant, grammar handle), None when empty


class Command(msgspec.Struct, array_like=True):
    command_id: int
    op: str                  # "compile" | "load_lora" | "unload_lora" | "shutdown"
    args: bytes              # pickled tuple


class EngineInput(msgspec.Struct, array_like=True):
    adds: list[AddRequest] = []
    aborts: list[str] = []
    commands: list[Command] = []


class Delta(msgspec.Struct, array_like=True):
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    rich: bytes | None       # pickled (new_logprobs, error, exception, prompt_logprobs) when any is set
    stop_reason: int | str | None = None


class Reply(msgspec.Struct, array_like=True):
    command_id: int
    ok: bool
    value: bytes             # pickled result, or the pickled exception when not ok


class AdapterStats(msgspec.Struct, array_like=True):
    loads_by_outcome: dict[str, int]
    load_buckets: list[tuple[str, int]]      # cumulative histogram buckets of load seconds
    load_seconds_sum: float
    num_host: int                            # resident in host memory (or being read)
    num_device: int                          # resident in device LoRA slots
    num_slot_writes: int = 0                 # adapters copied from host memory into a device slot, ever


class SpecStats(msgspec.Struct, array_like=True):
    """core/spec/stats.py's counters, as /metrics reads them."""
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    mean_acceptance_length: float


class Stats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_usage: float
    block_size: int
    num_blocks: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_prefix_queries_tokens: int
    num_prefix_hit_tokens: int
    num_preemptions: int
    num_kernel_compiles_after_warmup: int
    running_adapters: str
    waiting_adapters: str
    adapters: AdapterStats | None = None     # None: an engine without adapters
    spec: SpecStats | None = None            # None: speculative decoding off
    step_time_predicted_s: float = 0.0       # core/scheduling/step_time.py: the last step's predicted seconds
    step_time_error_ratio: float = 0.0       # mean |predicted - measured| / measured over its window
    step_budget_s: float = 0.0               # the last step's time budget for prefill chunks (0: none)


AdapterRow = tuple[str, str, str, int]   # (name, path, generation id, created) of a registered adapter


@dataclass(frozen=True)
class StartupInfo:
    """The `info` event's payload: the model is loaded (the warm-up comes next)."""
    facts: EngineFacts                 # computed by `core.engine.interface.engine_facts`, as in-process
    adapters: list[AdapterRow]


class EngineOutput(msgspec.Struct, array_like=True):
    deltas: list[Delta] = []
    replies: list[Reply] = []
    stats: Stats | None = None
    event: str | None = None          # "info" | "adapters" | "progress" | "ready" | "failed"
    payload: bytes | None = None      # the event's pickled data: StartupInfo | list[AdapterRow] |
    #                                   (done, total, seconds) | WarmupReport | (stage, exception)


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


def encode_delta(d: RequestDelta) -> Delta:
    rich = None
    if d.new_logprobs or d.error is not None or d.exception is not None or d.prompt_logprobs is not None:
        exc = d.exception
        try:
            blob = dumps((d.new_logprobs, d.error, exc, d.prompt_logprobs))
        except Exception:   # an exception that does not pickle: its message is enough
            blob = dumps((d.new_logprobs, d.error, None, d.prompt_logprobs))
        rich = blob
    return Delta(d.request_id, d.new_token_ids, d.new_text, d.finished, d.finish_reason, d.num_prompt_tokens,
                 d.num_output_tokens, d.num_cached_tokens, rich, d.stop_reason)


def decode_delta(d: Delta) -> RequestDelta:
    out = RequestDelta(request_id=d.request_id, new_token_ids=d.new_token_ids, new_text=d.new_text,
                       finished=d.finished, finish_reason=d.finish_reason, num_prompt_tokens=d.num_prompt_tokens,
                       num_output_tokens=d.num_output_tokens, num_cached_tokens=d.num_cached_tokens,
                       stop_reason=d.stop_reason)
    if d.rich is not None:
        out.new_logprobs, out.error, out.exception, out.prompt_logprobs = _loads_rich(d.rich)
    return out


def _loads_rich(blob: bytes) -> tuple[Any, ...]:
    try:
        return loads(blob)
    except Exception:   # an exception class that pickles but cannot be rebuilt: the request fails with a message
        return [], "the engine failed this request (its error could not be sent across processes)", None, None


INPUT_ENCODER = msgspec.msgpack.Encoder()
INPUT_DECODER = msgspec.msgpack.Decoder(EngineInput)
OUTPUT_ENCODER = msgspec.msgpack.Encoder()
OUTPUT_DECODER = msgspec.msgpack.Decoder(EngineOutput)
