"""Fixtures for grammar tests: tiny byte-level BPE and SentencePiece-style tokenizers."""

from __future__ import annotations

import os
from typing import Any

import pytest

from grammar_helpers import EXTRA_VOCAB, build_sentencepiece_tokenizer

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from tiny_models import build_tokenizer

    path = build_tokenizer(tmp_path_factory.mktemp("bpe") / "tok", vocab_size=512)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def spm_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    path = build_sentencepiece_tokenizer(tmp_path_factory.mktemp("spm") / "tok")
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def compiler(bpe_tokenizer: Any) -> Any:
    from grammar import GrammarCompiler

    c = GrammarCompiler(
        bpe_tokenizer, len(bpe_tokenizer) + EXTRA_VOCAB, [bpe_tokenizer.eos_token_id], compile_timeout_s=20.0
    )
    yield c
    c.close()


@pytest.fixture(scope="session")
def token_bytes(compiler: Any) -> dict[int, bytes]:
    return dict(compiler.vocab.tokens)
