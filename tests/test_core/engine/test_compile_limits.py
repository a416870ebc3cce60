"""The grammar compile limits come from LORAPLEX_GRAMMAR_* (core reads them, grammar/ never does): the engine's
compilers and the API process's schema lowering take `compile_limits()`; a bad value refuses to serve."""
from __future__ import annotations

import pytest

from core.engine.grammar_compilers import GrammarCompilers, compile_limits
from envlib import setenv
from grammar.compile.limits import CompileLimits


def test_compile_limits_from_the_environment() -> None:
    assert compile_limits({}) == CompileLimits()
    limits = compile_limits({"LORAPLEX_GRAMMAR_COMPILE_TIMEOUT_S": "0.5",
                             "LORAPLEX_GRAMMAR_WORKER_MEMORY_MB": "512",
                             "LORAPLEX_GRAMMAR_MAX_REGEX_CHARS": "30000"})
    assert (limits.compile_timeout_s, limits.worker_memory_bytes, limits.max_regex_chars) == (0.5, 512 << 20, 30000)
    options = limits.schema_options(512)
    assert options.max_regex_chars == 30000 and options.target_regex_chars <= 30000
    assert compile_limits({"LORAPLEX_GRAMMAR_WORKER_MEMORY_MB": "0"}).worker_memory_bytes == 0
    for name, bad in (("LORAPLEX_GRAMMAR_COMPILE_TIMEOUT_S", "0"), ("LORAPLEX_GRAMMAR_COMPILE_TIMEOUT_S", "x"),
                      ("LORAPLEX_GRAMMAR_WORKER_MEMORY_MB", "10"), ("LORAPLEX_GRAMMAR_MAX_REGEX_CHARS", "5")):
        with pytest.raises(ValueError, match=name):
            compile_limits({name: bad})


def test_the_engine_compilers_take_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, "LORAPLEX_GRAMMAR_COMPILE_TIMEOUT_S", "2.5")
    setenv(monkeypatch, "LORAPLEX_GRAMMAR_MAX_REGEX_CHARS", "20000")
    compilers = GrammarCompilers(tokenizer=None, vocab_size=512, eos_token_ids=[2])
    assert compilers.limits == CompileLimits(compile_timeout_s=2.5, max_regex_chars=20000)
    assert compilers.schema_options.max_regex_chars == 20000


def test_a_bad_limit_refuses_to_serve(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import build_parser, config_from_args

    monkeypatch.setenv("LORAPLEX_GRAMMAR_WORKER_MEMORY_MB", "lots")
    parser = build_parser()
    with pytest.raises(SystemExit) as info:
        config_from_args(parser.parse_args(["serve"]), parser)
    assert info.value.code == 2 and "LORAPLEX_GRAMMAR_WORKER_MEMORY_MB" in capsys.readouterr().err
