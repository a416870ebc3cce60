"""vLLM's `bad_words`: words the output may not complete, as token sequences, and the bans they cause.

Each word is tokenized twice, as vLLM does: as written (leading whitespace dropped) and after a space, so a word
is refused both at the start of the text and after a space (tokenizers that mark a word's leading space in the
token). The spaced form is kept only when it is a different spelling of the same length (its first token
differs); otherwise it would ban a prefix the bare form does not.

At each sampled position a sequence bans its last token when the output so far ends with the rest of it (a
one-token sequence: always). Only the output counts, not the prompt (vLLM's rule): a word the prompt leaves
half-written may be completed. The bans join the min_tokens bans of the step (core/sampling/penalties.py): a
grammar state whose only tokens are banned keeps them, so a constrained answer is still valid.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from core.sampling.params import MAX_BAD_WORDS, SamplingParams, SamplingParamsError

MAX_BAD_WORDS_TOKENS = 8192   # a request's bad-word sequences, all their tokens


def bad_words_token_ids(words: Sequence[str], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """The token sequences of `words` (SamplingParamsError naming `bad_words` for one that has none)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise SamplingParamsError(f"bad word {word[:40]!r} has no tokens", "bad_words")
        out.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    assert len(out) <= 2 * MAX_BAD_WORDS
    num_tokens = sum(len(seq) for seq in out)
    if num_tokens > MAX_BAD_WORDS_TOKENS:   # each step compares up to this many tokens per request
        raise SamplingParamsError(f"bad_words tokenize to {num_tokens} tokens (each word as written and after a "
                                  f"space); at most {MAX_BAD_WORDS_TOKENS} are allowed", "bad_words")
    return tuple(out)


def resolve_bad_words(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """`params` with `bad_words_token_ids` filled from its `bad_words` (unchanged if there are none or it is
    filled already)."""
    if not params.bad_words or params.bad_words_token_ids:
        return params
    return dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(params.bad_words, tokenizer))


def banned_by_bad_words(output_token_ids: Sequence[int], sequences: Sequence[Sequence[int]]) -> set[int]:
    """The tokens that would complete one of `sequences` after `output_token_ids`.

    Runs every step for each request with bad words (at most `MAX_BAD_WORDS_TOKENS` tokens in all): a sequence
    is skipped on its next-to-last token alone, and a longer prefix is compared as one slice (C speed), never
    token by token in Python, so an output built to match long prefixes costs microseconds, not milliseconds."""
    banned: set[int] = set()
    num_output = len(output_token_ids)
    last = output_token_ids[-1] if num_output else None
    tail: dict[int, tuple[int, ...]] = {}   # n -> the output's last n tokens
    for seq in sequences:
        n = len(seq) - 1
        if n == 0:
            banned.add(seq[0])
        elif n <= num_output and seq[n - 1] == last:
            if n not in tail:
                tail[n] = tuple(output_token_ids[num_output - n:])
            if tail[n] == tuple(seq[:n]):
                banned.add(seq[n])
    return banned
