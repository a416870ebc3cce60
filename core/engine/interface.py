"""The one engine interface the gateway talks to (`ServingEngine`), and the typed values it reads through it.

Two engines implement it: `core.engine.async_engine.AsyncEngine` (the engine loop on a thread of the API
process, `--engine-process off`) and `gateway.engine_client.client.EngineClient` (the engine core in its own
process, the serving default). The gateway never reaches past it into an engine's parts.

What the gateway reads of an engine, and where:
  requests    `check_request` (admission, before any child is submitted), `submit` / `abort` / `stream`
              (gateway/outputs/generation.py)
  model       `facts` (`EngineFacts`, computed in the engine by `engine_facts`: the engine process sends them
              in its start-up handshake): max_model_len (prompt bound, /tokenize, default max_tokens), vocab_size
              (prompt ids, generation defaults), model_dir (generation_config.json), device / block_size /
              num_kv_blocks (the start-up banner), eos_token_ids, schema_options (the schema checks at admission)
  tokenizer   prompts, chat templates, detokenization, tool and reasoning tags (always in the API process)
  grammar     `grammar_compiler` (`GrammarCompilerHandle`): submit / check / warm_lowering / vocab
  adapters    `adapters` (`AdapterCatalog`: lookup / entries / available), `load_lora` / `unload_lora` (admin)
  state       alive / warmed_up / ready / warmup_progress / error (/health, the start-up watcher),
              on_dead / fail (the server exits when the engine is gone), num_in_flight
  metrics     `stats()` (one `Stats` snapshot), `refresh()` (fresh state before a reader answers)
  lifecycle   `shutdown()`
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, NamedTuple, Protocol, Sequence, runtime_checkable

from core.engine.outputs import RequestDelta
from core.engine_core.protocol import Stats
from core.sampling.params import SamplingParams
from core.scheduling.admission import check_request
from grammar.compile.vocab import TokenVocab
from grammar.schema.lowering import SchemaOptions
from grammar.specs.spec import GrammarSpec

if TYPE_CHECKING:
    from core.engine.engine import LLMEngine

# Opaque to the gateway (it hands them on, never reads them):
Tokenizer = Any            # the model's transformers fast tokenizer (the API process calls it, never inspects it)
CompiledConstraint = Any   # a compiled output constraint: outlines-core index, xgrammar grammar, tool-call or
#                            reasoning wrapper, or the engine process's `RemoteGrammar` handle
Matcher = Any              # one request's matcher of a compiled constraint (`grammar.matching.matcher.make_matcher`)


class EngineDeadError(RuntimeError):
    """The engine loop is gone (HTTP 503)."""


class RequestFailedError(RuntimeError):
    """One request failed inside a healthy engine (HTTP 500)."""


class RequestCutError(RuntimeError):
    """The server ended this request at its shutdown deadline (`--shutdown-timeout`) before it finished (HTTP 503)."""


class EngineWarmingError(RuntimeError):
    """The engine is still compiling its kernels at start-up (HTTP 503, retry later)."""


class WarmupProgress(NamedTuple):
    """The start-up warm-up so far: kernel variants compiled, their total, seconds spent."""

    done: int = 0
    total: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class EngineFacts:
    """What the API process knows of the engine's model and KV pool, fixed once the model is loaded. Computed
    in the engine (`engine_facts`), so both engines answer from the same values the engine itself checks with."""

    model_dir: Path                    # the resolved model folder (generation_config.json; never shown to a tenant)
    device: str                        # "cpu", "cuda", "cuda:1"
    vocab_size: int                    # rows of the model's embedding (ids the model can embed)
    max_model_len: int                 # prompt + output tokens of one request
    eos_token_ids: tuple[int, ...]     # sorted
    block_size: int                    # tokens per KV block
    num_kv_blocks: int                 # blocks in the KV pool
    schema_options: SchemaOptions      # the engine's schema -> regex lowering limits (grammar/compile/limits.py)

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The engine's admission check (`LLMEngine.check_request`: RequestRejected -> 400); returns the
        request's resolved max_tokens."""
        return check_request(num_prompt_tokens, params, self.max_model_len, self.vocab_size, self.block_size,
                             self.num_kv_blocks)


def engine_facts(engine: "LLMEngine") -> EngineFacts:
    """The facts of a built engine (in-process, and in the engine process for its start-up handshake)."""
    return EngineFacts(model_dir=Path(engine.parts.model_dir), device=str(engine.device),
                       vocab_size=int(engine.model_config.vocab_size), max_model_len=int(engine.max_model_len),
                       eos_token_ids=tuple(sorted(int(i) for i in engine.eos_token_ids)),
                       block_size=int(engine.block_size), num_kv_blocks=int(engine.kv.num_blocks),
                       schema_options=engine.schema_options)


class AdapterEntry(Protocol):
    """A registered LoRA adapter as the gateway reads it (`adapters.registry.registry.LoadedAdapter`
    in-process, `gateway.engine_client.registry_mirror.RemoteAdapter` across the process boundary)."""

    @property
    def name(self) -> str: ...

    @property
    def path(self) -> str: ...          # server side only (logs, the admin answer), never in a tenant's answer

    @property
    def generation_id(self) -> str: ...

    @property
    def created(self) -> int: ...


class AdapterCatalog(Protocol):
    """The names a request may resolve to an adapter (`AdapterRegistry`, or its mirror in the API process)."""

    def lookup(self, name: str) -> AdapterEntry | None:
        """A registered adapter, or a `--lora-dir` entry (loaded on first use); None: unknown. Raises the
        remembered AdapterError of a directory adapter whose files failed to load."""
        ...

    def entries(self) -> Sequence[AdapterEntry]: ...

    def available(self) -> list[tuple[str, str]]:
        """(name, folder) of `--lora-dir` adapters not registered yet."""
        ...


class GrammarCompilerHandle(Protocol):
    """The engine's grammar compiler as the gateway uses it (`grammar.compile.compiler.GrammarCompiler`
    in-process; `gateway.engine_client.remote_compiler.RemoteCompiler` sends its compiles to the engine)."""

    def submit(self, spec: GrammarSpec) -> "concurrent.futures.Future[CompiledConstraint]": ...

    def check(self, spec: GrammarSpec) -> "concurrent.futures.Future[None]": ...

    def warm_lowering(self) -> None: ...

    @property
    def vocab(self) -> TokenVocab: ...   # token bytes: the free-text masks of `tool_choice: "auto"` / reasoning


@runtime_checkable
class ServingEngine(Protocol):
    """An engine serving the gateway (see the module docstring for who reads what)."""

    on_dead: list[Callable[[BaseException], None]]   # called once when the engine is gone for good

    # ---- model and tokenizer ------------------------------------------------------------------
    @property
    def facts(self) -> EngineFacts: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def grammar_compiler(self) -> GrammarCompilerHandle: ...

    @property
    def adapters(self) -> AdapterCatalog: ...

    # ---- state ----------------------------------------------------------------------------------
    @property
    def alive(self) -> bool: ...          # the engine loop runs (through the warm-up)

    @property
    def warmed_up(self) -> bool: ...      # past the start-up warm-up (stays True once the loop is dead)

    @property
    def ready(self) -> bool: ...          # alive and warmed up: /health 200

    @property
    def warmup_progress(self) -> WarmupProgress: ...

    @property
    def error(self) -> BaseException | None: ...   # why the engine is gone (None while it lives)

    @property
    def num_in_flight(self) -> int: ...   # request streams open

    def fail(self, reason: str) -> None:
        """Marks the engine gone from outside: open streams get the error, new requests 503, `on_dead` runs."""
        ...

    # ---- requests -------------------------------------------------------------------------------
    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """RequestRejected (400) for a request the engine can never serve; else its resolved max_tokens."""
        ...

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
               lora: AdapterEntry | None = None, grammar: Matcher | None = None,
               tenant: str | None = None, priority: int = 0) -> "asyncio.Queue[RequestDelta]":
        """Checks and queues one request (raises EngineDeadError, EngineWarmingError, RequestRejected, or an
        AdapterError 404 for an adapter unloaded since it was resolved); read its deltas with `stream`. `priority`
        orders it under the "priority" policy (lower first); the engine refuses any other than 0 elsewhere."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stream(self, request_id: str, queue: "asyncio.Queue[RequestDelta]") -> AsyncIterator[RequestDelta]:
        """The deltas of a submitted request; an error delta raises; leaving early aborts the request."""
        ...

    def cut_all(self, message: str) -> int:
        """Ends every open request's stream with RequestCutError(`message`) and aborts it in the engine (the
        shutdown deadline); returns how many. Streams opened later are not affected."""
        ...

    # ---- adapters -------------------------------------------------------------------------------
    def load_lora(self, name: str, path: str, replace: bool = False) -> AdapterEntry:
        """Reads, validates and registers an adapter (blocking: call it off the event loop); AdapterError.
        `replace`: a loaded adapter of that name is replaced (admin `load_inplace`), else a duplicate_adapter."""
        ...

    def unload_lora(self, name: str) -> None: ...

    # ---- metrics --------------------------------------------------------------------------------
    def stats(self) -> Stats | None:
        """The scheduler, KV pool and counters as one snapshot (None: not reported yet)."""
        ...

    async def refresh(self) -> None:
        """Before a reader of engine state answers (/metrics, model listings): the state as it is now."""
        ...

    # ---- lifecycle ------------------------------------------------------------------------------
    def shutdown(self) -> None: ...
