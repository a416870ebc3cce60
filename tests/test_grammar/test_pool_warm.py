"""Idle compile workers import what the pool's traffic needs before a request waits for it.

A compile worker imports xgrammar (about 3 s) at its first GBNF grammar. Before, each worker paid that import at
its own first grammar, inside a request (and `--request-timeout` counts a request's preparation): with N workers,
N requests waited for it. Now the first grammar makes the idle workers import it too, as the first schema already
did for the schema lowering, and a pool that never sees a grammar never imports it.
"""
from __future__ import annotations

import time
from typing import Any

from grammar.compile.compiler import GrammarCompiler
from grammar.specs.constraints import parse_constraints

WAIT_S = 90.0   # two imports of xgrammar one after the other, on a loaded 2-core CI machine


def wait_for(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_the_first_grammar_warms_the_idle_workers(bpe_tokenizer: Any) -> None:
    compiler = GrammarCompiler(bpe_tokenizer, len(bpe_tokenizer), [bpe_tokenizer.eos_token_id],
                               compile_timeout_s=30.0, num_workers=2)
    workers = compiler._pool._workers
    try:
        # a regex and a pause: a pool that has seen no grammar imports no grammar library
        assert compiler.compile(parse_constraints(None, {"guided_regex": "a[bc]"}, None)) is not None
        time.sleep(1.2)   # two idle polls
        assert not any(w.cfg_ready for w in workers)

        grammar = parse_constraints(None, {"guided_grammar": 'root ::= "yes" | "no"'}, None)
        assert compiler.compile(grammar) is not None
        assert sum(w.cfg_ready for w in workers) >= 1
        # the other worker follows while idle, so the next grammar that lands on it does not wait for the import
        assert wait_for(lambda: all(w.cfg_ready for w in workers), WAIT_S), [w.cfg_ready for w in workers]
    finally:
        compiler.close()


def test_a_compile_is_served_while_an_idle_worker_imports(bpe_tokenizer: Any) -> None:
    """One idle worker imports at a time: the other stays free, so a compile arriving meanwhile does not wait
    for an import it does not need."""
    compiler = GrammarCompiler(bpe_tokenizer, len(bpe_tokenizer), [bpe_tokenizer.eos_token_id],
                               compile_timeout_s=30.0, num_workers=2)
    pool = compiler._pool
    try:
        assert wait_for(lambda: len(pool.worker_pids) == 2, WAIT_S)
        pool._cfg_used.set()   # as after a first grammar: both idle workers want xgrammar
        assert wait_for(lambda: pool._warming.locked(), 10.0)   # one of them is importing it
        started = time.monotonic()
        assert compiler.compile(parse_constraints(None, {"guided_regex": "x[yz]+"}, None)) is not None
        # served by the worker that is not importing: never after an import (~3 s quiet) has finished
        assert pool._warming.locked() or time.monotonic() - started < 2.0
        assert sum(w.cfg_ready for w in pool._workers) <= 1
    finally:
        compiler.close()
