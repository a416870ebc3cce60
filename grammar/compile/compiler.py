"""GrammarCompiler: off-thread compiles with timeout, in-flight de-dup and an LRU cache.

The cache key is (spec.key, tokenizer fingerprint); entries are bounded by the bytes of
their serialized indexes.  Failed compiles (timeouts, the worker's memory limit, schemas
whose lowering fails, unbuildable regexes) are remembered in a small negative cache so
that a bad schema sent again fails at once instead of costing another worker timeout.
A JSON schema or tool spec carries a recipe: the worker lowers it (grammar/compile/lowering.py),
so nothing proportional to a schema's expansion runs in this process.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from grammar.compile.limits import DEFAULT_LIMITS
from grammar.matching.compiled import CompiledGrammar, MaskCache
from grammar.errors import SCHEMA_PARAM, GrammarError
from grammar.compile.lowering import END_CHAR, MARKER_CHARS
from grammar.compile.lowering import SENTINEL_REGEX, index_regex, with_param  # noqa: F401 - re-exported
from grammar.compile.pool import (CompileFailed, CompileMemoryExceeded, CompilePool, CompileResult, CompileResultTooLarge,
                          CompileTimeout)
from grammar.specs.spec import GrammarSpec, json_object_spec
from grammar.compile.vocab import TokenVocab, build_token_vocab
from grammar.cfg.worker_side import tokenizer_info
from grammar.cfg.cfg_grammar import CfgGrammar

NEGATIVE_CACHE_SIZE = 1024
NEGATIVE_CACHE_TTL_S = 300.0
CHECKED_CACHE_SIZE = 1024


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer / model vocabulary.

    Thread-safe: `submit` may be called from the gateway (wrap the Future with
    asyncio.wrap_future) while the engine thread uses finished CompiledGrammars.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        compile_timeout_s: float = DEFAULT_LIMITS.compile_timeout_s,
        cache_max_bytes: int = 512 << 20,
        num_workers: int = 2,
        mask_cache_bytes: int = 256 << 20,
        worker_memory_bytes: int = DEFAULT_LIMITS.worker_memory_bytes,
    ) -> None:
        """`compile_timeout_s`: CPU seconds one compile (a schema's lowering included) may take in a worker;
        `worker_memory_bytes`: each worker's address-space limit (0: none). grammar/compile/limits.py has the
        defaults and the environment variables the server reads them from."""
        self.vocab: TokenVocab = build_token_vocab(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.eos_token_ids = self.vocab.eos_token_ids
        self.fingerprint = self.vocab.fingerprint
        self.compile_timeout_s = compile_timeout_s
        self.worker_memory_bytes = worker_memory_bytes
        self.cache_max_bytes = cache_max_bytes
        self.masks = MaskCache(mask_cache_bytes)
        # an index larger than the whole cache is refused in the worker's pipe, never read into this process
        self._pool = CompilePool(self.vocab, num_workers, compile_timeout_s, worker_memory_bytes, cache_max_bytes)
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self._inflight: dict[tuple[str, str], Future] = {}
        self._views: dict[tuple[tuple[str, str], str | None], Future] = {}   # per (key, param) of _inflight
        self._cfg_info: Any = None  # xgrammar TokenizerInfo, built on the first grammar
        self._banned: tuple[frozenset[int], frozenset[int]] | None = None   # `_slots`: built on the first grammar
        self._failed: OrderedDict[tuple[str, str], tuple[float, GrammarError]] = OrderedDict()
        self._checked: OrderedDict[tuple[str, str], None] = OrderedDict()   # recipes whose lowering succeeded
        self.stats = {"hits": 0, "misses": 0, "dedup": 0, "timeouts": 0, "failures": 0, "evictions": 0}

    # -- public API ---------------------------------------------------------------------
    def submit(self, spec: GrammarSpec) -> "Future[CompiledGrammar]":
        """Compile off-thread (a recipe is lowered in the worker first); identical in-flight specs share one
        compile. A failure is a GrammarError naming the spec's field (`spec.param`)."""
        return self._submit(spec, check=False)

    def check(self, spec: GrammarSpec) -> "Future[None]":
        """Lower the spec's recipe in a worker without compiling it (tool schemas a request cannot call still get
        their 400); done at once for a spec without a recipe."""
        if spec.recipe is None:
            return _done(None)
        return self._submit(spec, check=True)

    def warm_lowering(self) -> None:
        """The first schema request is coming: the idle workers import the schema lowering (jsonschema: seconds)
        while the gateway checks the schema, instead of after."""
        self._pool.warm_lowering()

    @property
    def worker_pids(self) -> list[int]:
        """The compile workers' process ids (tests watch their memory)."""
        return self._pool.worker_pids

    def _submit(self, spec: GrammarSpec, check: bool) -> Future:
        key = (spec.key + ("/check" if check else ""), self.fingerprint)
        with self._lock:
            cached: Any = self._cache.get(key)
            if cached is not None or (check and (key in self._checked or (spec.key, self.fingerprint) in self._cache)):
                if cached is not None:
                    self._cache.move_to_end(key)
                self.stats["hits"] += 1
                return _done(cached)
            failed = self._failed.get(key)
            if failed is not None and time.monotonic() - failed[0] < NEGATIVE_CACHE_TTL_S:
                self.stats["hits"] += 1
                return _failed(with_param(failed[1], spec.param))
            shared = self._inflight.get(key)
            if shared is not None:
                self.stats["dedup"] += 1
                return self._view(key, shared, spec.param)
            self.stats["misses"] += 1
            shared = Future()
            shared.set_running_or_notify_cancel()
            self._inflight[key] = shared
            view = self._view(key, shared, spec.param)
        if spec.kind == "grammar":
            job = self._pool.submit(spec.ebnf or "", kind="cfg")
        elif spec.recipe is not None:
            job = self._pool.submit(spec.recipe, kind="check" if check else "recipe")
        else:
            job = self._pool.submit(index_regex(spec.regex))
        job.add_done_callback(lambda j: self._finish(key, spec, j, shared, check))
        return view

    def _view(self, key: tuple[str, str], shared: Future, param: str | None) -> Future:
        """The caller's future of an in-flight compile (one per field it names; lock held)."""
        view = self._views.get((key, param))
        if view is None:
            view = self._views[(key, param)] = _for_caller(shared, param)
        return view

    def compile(self, spec: GrammarSpec, timeout: float | None = None) -> CompiledGrammar:
        """Blocking compile; GrammarError(code='grammar_compile_timeout') on timeout."""
        future = self.submit(spec)
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            raise _timeout_error(timeout if timeout is not None else self.compile_timeout_s) from None

    def warmup_json_object(self) -> "Future[CompiledGrammar]":
        """Start compiling the json_object grammar in the background (call at start-up)."""
        return self.submit(json_object_spec())

    def clear_cache(self) -> None:
        """Drops every cached grammar (counted as evictions); grammars in use stay alive in their matchers."""
        with self._lock:
            self.stats["evictions"] += len(self._cache)
            self._cache.clear()
            self._cache_bytes = 0

    def close(self) -> None:
        self._pool.close()

    @property
    def cache_bytes(self) -> int:
        return self._cache_bytes

    def __len__(self) -> int:
        return len(self._cache)

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(g.nbytes for g in self._cache.values())
            assert total == self._cache_bytes, (total, self._cache_bytes)
            assert self._cache_bytes <= self.cache_max_bytes or len(self._cache) <= 1
            assert not set(self._cache) & set(self._inflight)
            assert {k for k, _ in self._views} <= set(self._inflight)
        self.masks.check_integrity()

    # -- internals ----------------------------------------------------------------------
    def _finish(self, key: tuple[str, str], spec: GrammarSpec, job: Future, future: Future,
                check: bool = False) -> None:
        """Settles the shared future with the compiled grammar or the error as the worker reported it (each
        caller's view names its own field: `_for_caller`)."""
        error: GrammarError | None = None
        compiled: CompiledGrammar | None = None
        try:
            result: CompileResult = job.result()
            if check:
                with self._lock:
                    self._forget_inflight(key)
                    self._checked[key] = None
                    while len(self._checked) > CHECKED_CACHE_SIZE:
                        self._checked.popitem(last=False)
                future.set_result(None)
                return
            compiled = self._cfg(spec, result) if spec.kind == "grammar" else CompiledGrammar(
                key=spec.key,
                kind=spec.kind,
                index=result.index,
                vocab_size=self.vocab_size,
                eos_token_ids=self.eos_token_ids,
                nbytes=result.nbytes,
                compile_seconds=result.seconds,
                mask_cache=self.masks,
                start_token_id=self._pool.sentinel_token_id,
                **self._slots(spec),
            )
        except CompileTimeout:
            error = _timeout_error(self.compile_timeout_s)
        except CompileMemoryExceeded as e:
            error = _memory_error(spec, f"compiling it needs more than {e.memory_bytes >> 20} MiB (the compile "
                                        f"worker's memory limit)")
        except CompileResultTooLarge as e:
            error = _memory_error(spec, f"its compiled grammar takes {e.num_bytes >> 20} MiB, more than the "
                                        f"grammar cache holds ({e.max_bytes >> 20} MiB)")
        except CompileFailed as e:
            error = _compile_failed(spec, str(e))
        except GrammarError as e:   # a grammar the vocabulary cannot start (`_cfg`)
            error = e
        except Exception as e:  # noqa: BLE001 - never leave a waiter hanging
            error = GrammarError(f"grammar compilation failed: {type(e).__name__}: {e}", "unsupported_json_schema")
        with self._lock:
            self._forget_inflight(key)
            if compiled is not None:
                self._insert(key, compiled)
            elif error is not None:
                self.stats["timeouts" if error.code == "grammar_compile_timeout" else "failures"] += 1
                self._failed[key] = (time.monotonic(), error)
                while len(self._failed) > NEGATIVE_CACHE_SIZE:
                    self._failed.popitem(last=False)
        if compiled is not None:
            future.set_result(compiled)
        else:
            future.set_exception(error)  # type: ignore[arg-type]

    def _forget_inflight(self, key: tuple[str, str]) -> None:
        self._inflight.pop(key, None)
        for view_key in [k for k in self._views if k[0] == key]:
            del self._views[view_key]

    def _cfg(self, spec: GrammarSpec, result: CompileResult) -> Any:
        with self._lock:
            if self._cfg_info is None:
                self._cfg_info = tokenizer_info(self.vocab.to_map(), self.vocab_size, list(self.eos_token_ids))
        grammar = CfgGrammar.from_worker(spec.key, result.index, self._cfg_info, self.vocab_size,
                                         self.eos_token_ids, result.seconds)
        start = grammar.new_matcher()
        if start.only_eos_allowed() and not start.is_final():   # no token can begin any string of the language
            raise GrammarError("the grammar admits no string that this model's tokens can spell",
                               "invalid_grammar", None)   # the caller's field: `_for_caller`
        return grammar

    def _slots(self, spec: GrammarSpec) -> dict[str, Any]:
        """The fake-token slots as CompiledGrammar takes them: the end slot (every outlines-core grammar is indexed
        as R + END, grammar/compile/lowering.py), a tool-call recipe's special tokens (`ToolCallsRecipe.markers`:
        the real id of each marker slot), and the real tokens that would write a slot's control character
        (END_CHAR's always, the marker characters' where the grammar has marker slots)."""
        real = tuple(getattr(spec.recipe, "markers", ()) or ())
        bad = next((t for t in real if not 0 <= t < self.vocab_size), None)
        if bad is not None:   # the grammar could never write it: no token would go on where it must come
            raise GrammarError(f"the grammar writes the special token id {bad}, outside the model's vocabulary "
                               f"[0, {self.vocab_size})", "invalid_tools", "tools")
        if self._banned is None:
            end = frozenset(t for t, data in self.vocab.tokens if END_CHAR in data)
            marker = frozenset(t for t, data in self.vocab.tokens if any(c in data for c in MARKER_CHARS))
            self._banned = (end, end | marker)
        return dict(markers=tuple(zip(real, self._pool.marker_token_ids)), banned=self._banned[bool(real)],
                    end_token_id=self._pool.end_token_id)

    def _insert(self, key: tuple[str, str], compiled: CompiledGrammar) -> None:
        self._cache[key] = compiled
        self._cache_bytes += compiled.nbytes
        while self._cache_bytes > self.cache_max_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= old.nbytes
            self.stats["evictions"] += 1


def _timeout_error(seconds: float, param: str | None = None) -> GrammarError:
    """The compile (lowering included) ran past the timeout: its worker was killed and restarted."""
    error = GrammarError(f"compiling the grammar for this schema took longer than {seconds:g} s (the compile "
                         f"timeout)", "grammar_compile_timeout")
    return with_param(error, param)


def _memory_error(spec: GrammarSpec, why: str) -> GrammarError:
    """The compile passed a memory bound: the worker was restarted; the spec's kind names the code."""
    what = {"regex": "regex", "choice": "choice", "grammar": "grammar", "tool_calls": "tool-call grammar"}
    code = {"regex": "invalid_regex", "grammar": "invalid_grammar", "choice": "invalid_structured_outputs"}
    param = SCHEMA_PARAM if spec.kind in ("json_schema", "json_object", "tool_calls") else None
    return GrammarError(f"the {what.get(spec.kind, 'schema')} is too complex: {why}",
                        code.get(spec.kind, "unsupported_json_schema"), param)  # type: ignore[arg-type]


def _compile_failed(spec: GrammarSpec, message: str) -> GrammarError:
    """A spec the compile worker rejected: a regex outlines-core cannot build, a grammar xgrammar refuses,
    or one whose language is empty (grammar/compile/worker.py `reaches_final`, grammar/cfg/emptiness.py). The param is
    the requesting spec's (`with_param` in `_for_caller`)."""
    message = message.removeprefix("ValueError: ")
    if spec.kind == "regex":
        return GrammarError(f"the regex cannot be compiled: {message}", "invalid_regex", None)
    if spec.kind == "grammar":
        return GrammarError(f"the grammar cannot be compiled: {message}", "invalid_grammar", None)
    return GrammarError(f"the schema cannot be compiled into a grammar: {message}", "unsupported_json_schema")


def _for_caller(shared: Future, param: str | None) -> Future:
    """One caller's view of a shared compile: its errors name the caller's field."""
    if shared.done():
        error = shared.exception()
        return _failed(with_param(error, param)) if isinstance(error, GrammarError) else shared
    out: Future = Future()
    out.set_running_or_notify_cancel()

    def settle(done: Future) -> None:
        error = done.exception()
        if error is None:
            out.set_result(done.result())
        else:
            out.set_exception(with_param(error, param) if isinstance(error, GrammarError) else error)

    shared.add_done_callback(settle)
    return out


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _failed(error: GrammarError) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future
