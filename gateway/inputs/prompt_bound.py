"""The most characters a prompt that fits the context can have: prompts longer than that are refused before they
are tokenized (the tokenizer's work, and memory, grow with the text; this check is one `len`).

Claim: a text of `c` characters that tokenizes to `n` tokens has `c <= shrink * max_token_chars * n`, so a text
longer than `shrink * max_token_chars * max_model_len` characters can never fit and no text that fits is refused.
It holds for the tokenizers `char_bound` accepts, and only for them:

- The added-token split cuts the text into added tokens (one token covering `len(content)` characters) and the
  rest. An added token with `lstrip`/`rstrip` swallows any run of whitespace into one token: no bound.
- The normalizer maps the rest to a string at least `1/shrink` as long: NFD/NFKD, lowercase, `Prepend` and
  `Replace` of a string by one at least as long never shorten it (shrink 1); NFC/NFKC compose into one character
  at most the characters of its full decomposition (shrink = the longest decomposition of any code point).
  A normalizer that deletes or collapses characters (Strip, StripAccents, Bert, Precompiled, Nmt, regex Replace):
  no bound.
- The pre-tokenizer drops nothing: ByteLevel turns each UTF-8 byte into one character (at least as many as the
  text had), Metaspace swaps ' ' for '▁' (and may prepend one), Split/Punctuation/Digits only cut. Whitespace
  splitters and `Removed` splits delete characters: no bound.
- The model covers every character of every piece with some token, and a token covers at most as many pieces'
  characters as its vocabulary string is long: BPE/Unigram token strings are the characters they cover
  (`continuing_subword_prefix`/`end_of_word_suffix` only lengthen the string); for byte-level BPE a vocabulary
  string has one character per byte, and a token of `k` bytes overlaps at most `k` characters of the text
  (each character is at least one byte). We use the vocabulary string, not the decoded text: a lone UTF-8
  continuation byte decodes to one '\ufffd' yet belongs to a character its neighbour token shares.
  An unknown character is covered by a byte-fallback token `<0xNN>` (6 >= 1), by one unfused `unk` token, or,
  where unknowns are fused into one `unk` or dropped (BPE without `unk_token`), not at all: no bound.
  WordPiece and WordLevel map a whole word of any length to one `unk`: no bound.
"""
from __future__ import annotations

import functools
import json
import logging
import sys
import unicodedata
from dataclasses import dataclass
from typing import Any

from core.engine.interface import Tokenizer

log = logging.getLogger("loraplex.gateway")

JSON_BYTES_PER_CHAR = 12      # the most JSON bytes one str character takes: "\ud83d\ude00" (a surrogate-pair escape)
BODY_PROMPTS = 4              # a body may carry this many prompts of the largest size that can fit...
BODY_SLACK_BYTES = 1 << 20    # ...plus this much for every other field (tools, schemas, sampling fields)
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


class Unbounded(Exception):
    """The tokenizer can map unboundedly many characters to one token (or to none): no character bound holds."""


@functools.lru_cache(maxsize=2)
def _longest_decomposition(form: str) -> int:
    """The most characters any one code point decomposes into under `form` (NFD or NFKD)."""
    longest = 1
    for cp in range(sys.maxunicode + 1):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        if unicodedata.decomposition(ch):
            longest = max(longest, len(unicodedata.normalize(form, ch)))
    return longest


def _shrink(normalizer: dict[str, Any] | None) -> int:
    """How many times shorter the normalizer can make a text (1: never shorter)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            factor *= _shrink(part)
        return factor
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"):   # ByteLevel: one character per byte
        return 1
    if kind in ("NFC", "NFKC"):
        return _longest_decomposition("NFD" if kind == "NFC" else "NFKD")
    if kind == "Replace":
        pattern, content = normalizer.get("pattern", {}), normalizer.get("content", "")
        if "String" in pattern and len(content) >= len(pattern["String"]) > 0:
            return 1
    raise Unbounded(f"normalizer {kind}")


def _check_pre_tokenizer(pre: dict[str, Any] | None) -> None:
    if pre is None:
        return
    kind = pre.get("type")
    if kind == "Sequence":
        for part in pre.get("pretokenizers", []):
            _check_pre_tokenizer(part)
        return
    if kind not in _SAFE_PRE_TOKENIZERS or pre.get("behavior") == "Removed":
        raise Unbounded(f"pre-tokenizer {kind} ({pre.get('behavior')})")


def _covers_every_character(model: dict[str, Any], byte_level: bool) -> None:
    """Raises Unbounded where unknown characters can be dropped or fused into one token."""
    kind = model.get("type")
    if kind not in ("BPE", "Unigram"):
        raise Unbounded(f"model {kind}")   # WordPiece / WordLevel: one unk for a whole word
    keys = set(_vocab_strings(model))
    if byte_level and kind == "BPE" and keys.issuperset(_byte_alphabet()):
        return   # every byte is a token: nothing is unknown
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in keys for b in range(256)):
        return
    if kind == "BPE" and model.get("unk_token") is not None and not model.get("fuse_unk"):
        return   # each unknown character is one unk token
    raise Unbounded(f"{kind} can drop or fuse unknown characters")


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> tuple[str, ...]:
    """GPT-2's byte-to-unicode characters: ByteLevel writes byte b as the b-th of these."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return tuple(chars[b] for b in range(256))


def _is_byte_level(spec: dict[str, Any]) -> bool:
    """ByteLevel as the pre-tokenizer or the normalizer (alone or in a Sequence)."""
    pre, norm = spec.get("pre_tokenizer") or {}, spec.get("normalizer") or {}
    parts = (pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]) + (
        norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm])
    return any(p.get("type") == "ByteLevel" for p in parts)


def _vocab_strings(model: dict[str, Any]) -> list[str]:
    vocab = model.get("vocab") or {}
    return list(vocab.keys()) if isinstance(vocab, dict) else [entry[0] for entry in vocab]


def max_chars_per_token(spec: dict[str, Any]) -> tuple[int, int]:
    """(shrink, max_token_chars) of a `tokenizer.json` document; raises Unbounded where no bound holds."""
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        raise Unbounded("an added token strips the whitespace around it")
    shrink = _shrink(spec.get("normalizer"))
    _check_pre_tokenizer(spec.get("pre_tokenizer"))
    model = spec.get("model") or {}
    _covers_every_character(model, _is_byte_level(spec))
    longest = max((len(s) for s in _vocab_strings(model)), default=1)
    longest = max([longest, 1] + [len(a.get("content", "")) for a in added])
    return shrink, longest


@dataclass(frozen=True)
class CharBound:
    """`max_chars`: the longest text that can fit `max_model_len` tokens; None where the tokenizer gives no bound
    (then only the body's hard cap applies). `max_body_bytes`: the generous body cap derived from it."""

    max_model_len: int
    max_token_chars: int | None
    shrink: int = 1

    @property
    def max_chars(self) -> int | None:
        if self.max_token_chars is None:
            return None
        return self.shrink * self.max_token_chars * self.max_model_len

    @property
    def max_body_bytes(self) -> int | None:
        chars = self.max_chars
        return None if chars is None else BODY_PROMPTS * JSON_BYTES_PER_CHAR * chars + BODY_SLACK_BYTES


def char_bound(tokenizer: Tokenizer, max_model_len: int) -> CharBound:
    """The bound for a transformers fast tokenizer (read once at start-up from its `tokenizer.json`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        if backend is None:
            raise Unbounded("not a fast tokenizer")
        shrink, longest = max_chars_per_token(json.loads(backend.to_str()))
    except Unbounded as exc:
        log.warning("no character bound on prompts for this tokenizer (%s): every prompt under the body cap "
                    "is tokenized", exc)
        return CharBound(max_model_len, None)
    return CharBound(max_model_len, longest, shrink)
