"""A byte-level BPE tokenizer of any size, built programmatically (no training, no download, ~1 s at 128k ids).

The GPU benchmarks keep Llama-3-8B's vocabulary (128,256 logits: the LM head and the grammar bitmask cost what
they cost) and need a tokenizer of the same size whose every id decodes to text. A small trained tokenizer on a
large vocabulary leaves most sampled ids without text (they decode to nothing), and a benchmark that stamps text
chunks then measures the wrong thing (issue 33: TTFT/ITL off by 10-100x).

Layout, deterministic for a given size:
  ids 0-6        the special tokens of tests/helpers/tiny_models.py (<pad> <s> </s> and the chat markers)
  next 128 ids   the ASCII bytes 0x00-0x7F (as GPT-2's byte-to-unicode characters)
  then merges    every 2-character string of printable ASCII and '\\n', then 3-character strings over
                 [ a-z0-9"{}:,.], then ' ' + 3 lowercase letters, then 4 lowercase letters, ... until the size.
Every merged token is ASCII, so each id alone decodes to non-empty, complete text (no '\\ufffd', no held-back
partial UTF-8 character). Bytes 0x80-0xFF are not in the vocabulary: non-ASCII input characters are dropped by
the encoder (the benchmarks' prompts are ASCII).

    python benchmarks/synthetic_tokenizer.py OUT_DIR [VOCAB_SIZE]
"""
from __future__ import annotations

import itertools
import json
import string
import sys
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the packages first: tests/grammar/ would shadow grammar/
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))   # tests/helpers/tiny_models.py
from tiny_models import BOS, CHAT_MARKERS, CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS

PRINTABLE = [c for c in string.printable if c not in "\t\r\x0b\x0c"]   # 95 printable characters + '\n'
TIER3 = ' abcdefghijklmnopqrstuvwxyz0123456789"{}:,.'
LOWER = string.ascii_lowercase


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _merged_strings() -> Iterator[str]:
    """Token texts of 2+ characters in merge order; each one's prefix (all but its last character) comes
    earlier (or is a single byte), so every merge joins two tokens that exist."""
    yield from ("".join(p) for p in itertools.product(PRINTABLE, repeat=2))
    yield from ("".join(p) for p in itertools.product(TIER3, repeat=3))
    yield from (" " + "".join(p) for p in itertools.product(LOWER, repeat=3))
    for n in itertools.count(4):      # lowercase words: prefix of length n-1 is emitted in the tier before
        yield from ("".join(p) for p in itertools.product(LOWER, repeat=n))
        yield from (" " + "".join(p) for p in itertools.product(LOWER, repeat=n))


def vocabulary(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(token -> id, merges) of a tokenizer with exactly `vocab_size` ids."""
    table = byte_to_unicode()
    vocab: dict[str, int] = {}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    for b in range(128):
        vocab[table[b]] = len(vocab)
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size must be at least {len(vocab)}")
    merges: list[tuple[str, str]] = []
    for text in _merged_strings():
        if len(vocab) >= vocab_size:
            break
        enc = "".join(table[b] for b in text.encode("ascii"))
        if enc in vocab:
            continue
        left, right = enc[:-1], enc[-1]
        if left not in vocab:         # only strings whose prefix is a token (true by construction)
            continue
        vocab[enc] = len(vocab)
        merges.append((left, right))
    return vocab, merges


def build_synthetic_tokenizer(out_dir: str | Path, vocab_size: int) -> Path:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json (as tests/helpers/tiny_models.py does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    out = Path(out_dir)
    vocab, merges = vocabulary(vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, vocab[BOS])])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {str(vocab[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
              "unk_token": None, "add_bos_token": True, "add_eos_token": False,
              "additional_special_tokens": list(CHAT_MARKERS), "added_tokens_decoder": added,
              "clean_up_tokenization_spaces": False, "model_max_length": 1_000_000, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "additional_special_tokens": list(CHAT_MARKERS)}))
    return out


if __name__ == "__main__":
    from transformers import AutoTokenizer

    path = build_synthetic_tokenizer(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 128_256)
    print(path, len(AutoTokenizer.from_pretrained(path)))
