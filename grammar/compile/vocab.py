"""HF tokenizer -> the byte string of every token (what outlines-core matches on).

Byte-level BPE (GPT-2, Llama 3, Qwen2): token strings are bytes mapped through the
GPT-2 byte-to-unicode table.  SentencePiece (Llama 2, Mistral): '▁' is a space and
`<0xNN>` tokens are raw bytes.  Special tokens (and ids beyond the model's logits
width) never enter the grammar's vocabulary; EOS ids are handled by the matcher.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

SPIECE_SPACE = "\u2581"


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    bs = printable[:]
    cs = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@dataclass(frozen=True)
class TokenVocab:
    """Token bytes for the grammar: `tokens[i] = (token_id, bytes)`."""

    tokens: tuple[tuple[int, bytes], ...]
    vocab_size: int  # the model's logits width
    eos_token_ids: tuple[int, ...]
    kind: str  # "byte_level" | "sentencepiece" | "plain"
    fingerprint: str

    def to_map(self) -> dict[bytes, list[int]]:
        out: dict[bytes, list[int]] = {}
        for token_id, data in self.tokens:
            out.setdefault(data, []).append(token_id)
        return out


def _backend_json(tokenizer: Any) -> dict[str, Any]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return {}
    try:
        return json.loads(backend.to_str())
    except Exception:
        return {}


def _contains_type(obj: Any, names: set[str]) -> bool:
    if isinstance(obj, dict):
        if obj.get("type") in names:
            return True
        return any(_contains_type(v, names) for v in obj.values())
    if isinstance(obj, list):
        return any(_contains_type(v, names) for v in obj)
    return False


def detect_kind(tokenizer: Any, vocab: dict[str, int]) -> str:
    spec = _backend_json(tokenizer)
    if spec:
        byte_level = {"ByteLevel"}
        if _contains_type(spec.get("decoder"), byte_level) or _contains_type(spec.get("pre_tokenizer"), byte_level):
            return "byte_level"
        model = spec.get("model") or {}
        if model.get("byte_fallback") or _contains_type(spec.get("decoder"), {"Metaspace", "ByteFallback"}):
            return "sentencepiece"
    sample = list(vocab)[:5000]
    if any(SPIECE_SPACE in t for t in sample) or "<0x0A>" in vocab:
        return "sentencepiece"
    if any("\u0120" in t for t in sample):  # 'Ġ' (space in the GPT-2 table)
        return "byte_level"
    return "plain"


def token_bytes(token: str, kind: str) -> bytes | None:
    """Bytes a token decodes to inside a text; None when it cannot be represented."""
    if kind == "byte_level":
        table = unicode_to_byte()
        try:
            return bytes(table[c] for c in token)
        except KeyError:
            return None
    if kind == "sentencepiece":
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                return None
        return token.replace(SPIECE_SPACE, " ").encode("utf-8")
    return token.encode("utf-8")


def build_token_vocab(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> TokenVocab:
    vocab: dict[str, int] = tokenizer.get_vocab()
    kind = detect_kind(tokenizer, vocab)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = {}
    get_added = getattr(tokenizer, "get_added_vocab", None)
    if get_added is not None:
        added = get_added()
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {i for i, tok in decoder.items() if getattr(tok, "special", False)}
    eos = tuple(sorted(set(eos_token_ids)))
    tokens: list[tuple[int, bytes]] = []
    for token, token_id in vocab.items():
        if token_id >= vocab_size or token_id in special or token_id in eos:
            continue
        data = token.encode("utf-8") if token in added else token_bytes(token, kind)
        if data:
            tokens.append((token_id, data))
    tokens.sort()
    digest = hashlib.sha256()
    digest.update(f"{kind}|{vocab_size}|{eos}".encode())
    for token_id, data in tokens:
        digest.update(token_id.to_bytes(4, "little") + len(data).to_bytes(2, "little") + data)
    return TokenVocab(tuple(tokens), vocab_size, eos, kind, digest.hexdigest()[:24])
