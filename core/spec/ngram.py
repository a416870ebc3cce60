"""Prompt-lookup (n-gram) proposals: copy what followed the last occurrence of the sequence's suffix.

For n from `max_n` down to `min_n` (longest match first), the last n tokens of prompt + output are looked
up in the earlier tokens; at the most recent earlier occurrence, the up to k tokens that followed it are the
proposal. No model runs: the proposal is a deterministic function of the token ids (a one-hot draft
distribution for the rejection sampler).
"""
from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: "list[int] | np.ndarray", k: int, min_n: int, max_n: int,
                  max_search: int = 4096) -> list[int]:
    """Up to `k` proposed next tokens (empty when no suffix of length in [min_n, max_n] recurs).
    Only the last `max_search` tokens are searched, so the cost per step stays bounded."""
    tokens = np.asarray(token_ids[-max_search:], dtype=np.int64)
    num = len(tokens)
    top = min(max_n, num - 1)
    if k <= 0 or top < min_n:
        return []
    # earlier positions holding the last token: where an occurrence of the suffix may end (something follows)
    ends = np.flatnonzero(tokens[:num - 1] == tokens[num - 1])                  # [C]
    length = np.ones(len(ends), dtype=np.int64)            # [C] suffix tokens matched there (up to `top`)
    alive = np.ones(len(ends), dtype=bool)                 # [C] still matching at distance d
    for d in range(1, top):
        ok = alive & (ends >= d)
        ok[ok] = tokens[ends[ok] - d] == tokens[num - 1 - d]
        alive = ok
        length += alive
    for n in range(top, min_n - 1, -1):                    # longest match first, then the most recent
        hits = ends[length >= n]
        if len(hits):
            # copy what followed; a copy that reaches the end goes on with its own tokens (a repeating
            # pattern continues its period, as an overlapping LZ77 copy does)
            start = int(hits[-1]) + 1
            out = tokens[start:start + k].tolist()
            while len(out) < k:
                out.append(out[len(out) - (num - start)])
            return out
    return []
