"""Helpers shared by the grammar tests (imported by conftest and test modules)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

SCHEMA_BENCH = Path(__file__).resolve().parents[3] / "shared" / "jsonschemabench"
EXTRA_VOCAB = 8  # model logits wider than the tokenizer, as real checkpoints often are


def build_sentencepiece_tokenizer(out_dir: Path, vocab_size: int = 400) -> Path:
    """A Llama-2 / Mistral style tokenizer: '▁' for spaces, <0xNN> byte-fallback tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tiny_models import iter_stdlib_text

    texts = iter_stdlib_text(20, 10_000)
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, limit_alphabet=80)
    base.train_from_iterator(texts, trainer=trainer)
    spec = json.loads(base.to_str())
    learned = spec["model"]["vocab"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for token in sorted(learned, key=learned.get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Metaspace(replacement="\u2581", prepend_scheme="first"), decoders.ByteFallback(), decoders.Fuse()]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out_dir)
    return out_dir


def python_regex(regex: str) -> str:
    """Our outlines-core regex in Python `re` syntax (\\x{HHHH} -> \\U0000HHHH)."""
    return re.sub(r"\\x\{([0-9A-Fa-f]+)\}", lambda m: "\\U%08x" % int(m.group(1), 16), regex)


def matches(regex: str, text: str) -> bool:
    return re.fullmatch(python_regex(regex), text) is not None


def json_schema_format(schema: Any, name: str = "t") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def lowered(spec: Any) -> Any:
    """`spec` with the regex a compile worker would build for it (lowered here, raising the worker's
    GrammarError); None stays None."""
    import dataclasses

    from grammar.compile.lowering import lower_spec

    return None if spec is None else dataclasses.replace(spec, regex=lower_spec(spec))


def admit(response_format: Any, *options: Any) -> Any:
    """What admission + the worker's lowering make of a response_format: the spec with its regex, or the
    GrammarError either raises."""
    from grammar import parse_response_format

    return lowered(parse_response_format(response_format, *options))


def walk_and_validate(compiler: Any, schema: Any, walks: int = 5, seed: int = 0, max_tokens: int = 3000) -> int:
    """Compile `schema`, run random constrained generations, assert every finished
    output validates (Draft 2020-12, formats asserted).  Returns the finished count."""
    import random

    from format_checks import strict_validator

    from grammar import parse_response_format
    from grammar_sim import distances_to_final, random_walk

    spec = parse_response_format(json_schema_format(schema))
    compiled = compiler.compile(spec, timeout=60)
    validator = strict_validator(schema)
    token_bytes = dict(compiler.vocab.tokens)
    dist = distances_to_final(compiled)
    rng = random.Random(seed)
    finished = 0
    for _ in range(walks):
        walk = random_walk(compiled, token_bytes, rng, max_tokens=max_tokens, dist=dist)
        if not walk.finished:
            continue
        finished += 1
        value = json.loads(walk.text)
        errors = [e.message for e in validator.iter_errors(value)]
        assert not errors, f"invalid output {walk.text!r} for {json.dumps(schema)[:300]}: {errors[:3]}"
    return finished


def drive_matcher(matcher: Any, vocab_size: int, forced: list[int], seed: int,
                  check: Callable[[list[int]], None] | None = None, max_tokens: int = 300) -> list[int]:
    """A walk through a matcher's masks until it terminates: the `forced` tokens first (each must be allowed), then
    random allowed ones; `check(allowed)` sees every mask. Returns the tokens written."""
    import random

    from grammar.matching.bitmask import allocate_token_bitmask, unpack_bitmask

    forced, out, rng = list(forced), [], random.Random(seed)
    while not matcher.is_terminated() and len(out) < max_tokens:
        bitmask = allocate_token_bitmask(1, vocab_size)
        matcher.fill_bitmask(bitmask, 0)
        allowed = unpack_bitmask(bitmask, vocab_size)[0].nonzero().flatten().tolist()
        assert allowed, "a state that allows no token"
        if check is not None:
            check(allowed)
        token = forced.pop(0) if forced else rng.choice(allowed)
        assert token in allowed and matcher.accept_token(token), token
        out.append(token)
    assert matcher.is_terminated()
    return out


def decoded(tokenizer: Any, ids: list[int]) -> str:
    """The text of written ids, special tokens kept, EOS left out."""
    return tokenizer.decode([t for t in ids if t != tokenizer.eos_token_id], skip_special_tokens=False)
