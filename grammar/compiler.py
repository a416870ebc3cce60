"""GrammarCompiler: off-thread compiles with timeout, in-flight de-dup and an LRU cache.

The cache key is (spec.key, tokenizer fingerprint); entries are bounded by the bytes of
their serialized indexes.  Failed compiles (timeouts, unbuildable regexes) are
remembered in a small negative cache so that a bad schema sent again fails at once
instead of costing another worker timeout.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from grammar.compiled import CompiledGrammar, MaskCache
from grammar.errors import GrammarError
from grammar.pool import CompileFailed, CompilePool, CompileResult, CompileTimeout
from grammar.spec import GrammarSpec, json_object_spec
from grammar.vocab import TokenVocab, build_token_vocab

NEGATIVE_CACHE_SIZE = 1024
NEGATIVE_CACHE_TTL_S = 300.0
SENTINEL_REGEX = r"\x{1}"


def index_regex(regex: str) -> str:
    """The regex actually given to outlines-core: SENTINEL + "(?:R)".

    outlines-core also determinizes regex-automata's *unanchored* DFA, whose size
    explodes when R cannot match early (R starts with '{': every '{' of the input is a
    potential match start, and nested objects multiply them).  A leading sentinel
    character that R never contains (U+0001: JSON text has no raw control characters)
    limits unanchored match starts to the position after the last sentinel, so the build
    costs what the anchored DFA costs: 100-1000x faster on JSON grammars.  The sentinel
    is a fake token (id vocab_size + 1, never in a mask) that CompiledGrammar consumes
    once; its target state is the grammar's initial state.
    """
    return f"{SENTINEL_REGEX}(?:{regex})"


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
        compile_timeout_s: float = 10.0,
        cache_max_bytes: int = 512 << 20,
        num_workers: int = 2,
        mask_cache_bytes: int = 256 << 20,
    ) -> None:
        self.vocab: TokenVocab = build_token_vocab(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.eos_token_ids = self.vocab.eos_token_ids
        self.fingerprint = self.vocab.fingerprint
        self.compile_timeout_s = compile_timeout_s
        self.cache_max_bytes = cache_max_bytes
        self.masks = MaskCache(mask_cache_bytes)
        self._pool = CompilePool(self.vocab, num_workers, compile_timeout_s)
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self._inflight: dict[tuple[str, str], Future] = {}
        self._cfg_info: Any = None  # xgrammar TokenizerInfo, built on the first grammar
        self._failed: OrderedDict[tuple[str, str], tuple[float, GrammarError]] = OrderedDict()
        self.stats = {"hits": 0, "misses": 0, "dedup": 0, "timeouts": 0, "failures": 0, "evictions": 0}

    # -- public API ---------------------------------------------------------------------
    def submit(self, spec: GrammarSpec) -> "Future[CompiledGrammar]":
        """Compile off-thread; identical in-flight specs share one Future."""
        key = (spec.key, self.fingerprint)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.stats["hits"] += 1
                return _done(cached)
            failed = self._failed.get(key)
            if failed is not None and time.monotonic() - failed[0] < NEGATIVE_CACHE_TTL_S:
                self.stats["hits"] += 1
                return _failed(failed[1])
            inflight = self._inflight.get(key)
            if inflight is not None:
                self.stats["dedup"] += 1
                return inflight
            self.stats["misses"] += 1
            future: Future = Future()
            future.set_running_or_notify_cancel()
            self._inflight[key] = future
        if spec.kind == "grammar":
            job = self._pool.submit(spec.ebnf or "", kind="cfg")
        else:
            job = self._pool.submit(index_regex(spec.regex))
        job.add_done_callback(lambda j: self._finish(key, spec, j, future))
        return future

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
        self.masks.check_integrity()

    # -- internals ----------------------------------------------------------------------
    def _finish(self, key: tuple[str, str], spec: GrammarSpec, job: Future, future: Future) -> None:
        error: GrammarError | None = None
        compiled: CompiledGrammar | None = None
        try:
            result: CompileResult = job.result()
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
            )
        except CompileTimeout:
            error = _timeout_error(self.compile_timeout_s, spec.param)
        except CompileFailed as e:
            error = _compile_failed(spec, str(e))
        except GrammarError as e:   # a grammar the vocabulary cannot start (`_cfg`)
            error = e
        except Exception as e:  # noqa: BLE001 - never leave a waiter hanging
            error = GrammarError(f"grammar compilation failed: {type(e).__name__}: {e}", "unsupported_json_schema")
        with self._lock:
            self._inflight.pop(key, None)
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

    def _cfg(self, spec: GrammarSpec, result: CompileResult) -> Any:
        from grammar.cfg import CfgGrammar
        from grammar.cfg_compile import tokenizer_info

        with self._lock:
            if self._cfg_info is None:
                self._cfg_info = tokenizer_info(self.vocab.to_map(), self.vocab_size, list(self.eos_token_ids))
        grammar = CfgGrammar.from_worker(spec.key, result.index, self._cfg_info, self.vocab_size,
                                         self.eos_token_ids, result.seconds)
        start = grammar.new_matcher()
        if start.only_eos_allowed() and not start.is_final():   # no token can begin any string of the language
            raise GrammarError("the grammar admits no string that this model's tokens can spell",
                               "invalid_grammar", spec.param)
        return grammar

    def _insert(self, key: tuple[str, str], compiled: CompiledGrammar) -> None:
        self._cache[key] = compiled
        self._cache_bytes += compiled.nbytes
        while self._cache_bytes > self.cache_max_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= old.nbytes
            self.stats["evictions"] += 1


def _timeout_error(seconds: float, param: str | None = None) -> GrammarError:
    error = GrammarError(f"compiling the grammar for this schema took longer than {seconds:g} s",
                         "grammar_compile_timeout")
    if param is not None:
        error.param = param
    return error


def _compile_failed(spec: GrammarSpec, message: str) -> GrammarError:
    """A spec the compile worker rejected: a regex outlines-core cannot build, a grammar xgrammar refuses,
    or one whose language is empty (grammar/_worker.py `reaches_final`, grammar/cfg_empty.py)."""
    message = message.removeprefix("ValueError: ")
    if spec.kind == "regex":
        return GrammarError(f"the regex cannot be compiled: {message}", "invalid_regex", spec.param)
    if spec.kind == "grammar":
        return GrammarError(f"the grammar cannot be compiled: {message}", "invalid_grammar", spec.param)
    error = GrammarError(f"the schema cannot be compiled into a grammar: {message}", "unsupported_json_schema")
    if spec.param is not None:
        error.param = spec.param
    return error


def _done(value: CompiledGrammar) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _failed(error: GrammarError) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future
