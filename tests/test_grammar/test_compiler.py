"""GrammarCompiler: cache, in-flight de-dup, compile timeout with worker restart, LRU by bytes."""

from __future__ import annotations

import time
from typing import Any

import pytest
from grammar_helpers import EXTRA_VOCAB, json_schema_format

from grammar import GrammarCompiler, GrammarError, json_object_spec, parse_response_format
from grammar.compile.compiler import index_regex

# (a|b)*a(a|b){k}: the minimal DFA has 2^k states, so the index build takes minutes.
PATHOLOGICAL = {"type": "string", "pattern": "^[ab]*a[ab]{22}$"}


def spec_for(schema: Any):  # noqa: ANN201
    spec = parse_response_format(json_schema_format(schema))
    assert spec is not None
    return spec


def test_compile_and_cache_hit(compiler: GrammarCompiler, bpe_tokenizer: Any) -> None:
    spec = spec_for({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    first = compiler.compile(spec)
    hits = compiler.stats["hits"]
    second = compiler.compile(spec)
    assert second is first and compiler.stats["hits"] == hits + 1
    assert first.vocab_size == len(bpe_tokenizer) + EXTRA_VOCAB
    compiler.check_integrity()


def test_inflight_dedup(compiler: GrammarCompiler) -> None:
    spec = spec_for({"type": "array", "items": {"type": "string", "maxLength": 7}, "maxItems": 3})
    dedup = compiler.stats["dedup"]
    f1 = compiler.submit(spec)
    f2 = compiler.submit(spec)
    assert f2 is f1 and compiler.stats["dedup"] == dedup + 1
    assert f1.result(timeout=30) is f2.result(timeout=30)
    assert compiler.submit(spec).result() is f1.result()  # now a cache hit
    compiler.check_integrity()


def test_json_object_warmup(compiler: GrammarCompiler) -> None:
    future = compiler.warmup_json_object()
    compiled = future.result(timeout=60)
    assert compiled.kind == "json_object"
    assert compiler.compile(json_object_spec()) is compiled


def test_sentinel_wrapping() -> None:
    assert index_regex("a|b") == r"\x{1}(?:a|b)\x{4}"   # the sentinel, R, the end slot


@pytest.fixture()
def slow_compiler(bpe_tokenizer: Any) -> GrammarCompiler:
    c = GrammarCompiler(bpe_tokenizer, len(bpe_tokenizer), [bpe_tokenizer.eos_token_id],
                        compile_timeout_s=1.5, num_workers=1)
    yield c
    c.close()


def test_compile_timeout_kills_and_restarts_worker(slow_compiler: GrammarCompiler) -> None:
    spec = spec_for(PATHOLOGICAL)  # admission itself is cheap
    slow_compiler.compile(spec_for({"type": "integer"}))   # the worker's start and its imports, off the clock
    start = time.perf_counter()
    with pytest.raises(GrammarError) as info:
        slow_compiler.compile(spec)
    elapsed = time.perf_counter() - start
    assert info.value.code == "grammar_compile_timeout"
    assert elapsed < 10.0
    assert slow_compiler.stats["timeouts"] == 1
    # the worker was killed and replaced: the next compile succeeds promptly
    start = time.perf_counter()
    compiled = slow_compiler.compile(spec_for({"type": "boolean"}))
    assert compiled is not None and time.perf_counter() - start < 10.0
    assert slow_compiler._pool.restarts == 1
    # the failure is remembered: resubmitting fails at once from the negative cache, without a worker
    misses, hits = slow_compiler.stats["misses"], slow_compiler.stats["hits"]
    submit = slow_compiler._pool.submit
    slow_compiler._pool.submit = lambda *a, **k: pytest.fail("a remembered failure was compiled again")
    try:
        with pytest.raises(GrammarError) as again:
            slow_compiler.compile(spec)
    finally:
        slow_compiler._pool.submit = submit
    assert again.value.code == "grammar_compile_timeout"
    assert slow_compiler.stats["misses"] == misses and slow_compiler.stats["hits"] == hits + 1
    assert slow_compiler.stats["timeouts"] == 1 and slow_compiler._pool.restarts == 1


def test_caller_side_timeout(slow_compiler: GrammarCompiler) -> None:
    spec = spec_for({"type": "string", "pattern": "^[ab]*a[ab]{21}$"})
    with pytest.raises(GrammarError) as info:
        slow_compiler.compile(spec, timeout=0.05)
    assert info.value.code == "grammar_compile_timeout"


def test_lru_bounded_by_bytes(bpe_tokenizer: Any) -> None:
    c = GrammarCompiler(bpe_tokenizer, len(bpe_tokenizer), [bpe_tokenizer.eos_token_id],
                        cache_max_bytes=40_000, num_workers=1)
    try:
        sizes = []
        for n in range(6):
            compiled = c.compile(spec_for({"type": "string", "minLength": n, "maxLength": n + 5}))
            sizes.append(compiled.nbytes)
            c.check_integrity()
        assert c.stats["evictions"] > 0
        assert c.cache_bytes <= 40_000 or len(c) == 1
        assert sum(sizes) > 40_000
    finally:
        c.close()


def test_unbuildable_regex_is_an_admission_error(compiler: GrammarCompiler) -> None:
    from grammar.specs.spec import GrammarSpec

    bad = GrammarSpec("json_schema", "(unclosed", "deadbeef")
    with pytest.raises(GrammarError) as info:
        compiler.compile(bad)
    assert info.value.code == "unsupported_json_schema"
