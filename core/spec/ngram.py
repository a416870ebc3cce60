"""Prompt-lookup (n-gram) proposals: copy what followed the last occurrence of the sequence's suffix.

For n from `max_n` down to `min_n` (longest match first), the last n tokens of prompt + output are looked
up in the earlier tokens; at the most recent earlier occurrence, the up to k tokens that followed it are the
proposal. No model runs: the proposal is a deterministic function of the token ids (a one-hot draft
distribution for the rejection sampler).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: "list[int] | np.ndarray", k: int, min_n: int, max_n: int,
                  max_search: int = 4096) -> list[int]:
    """Up to `k` proposed next tokens (empty when no suffix of length in [min_n, max_n] recurs).
    Only the last `max_search` tokens are searched, so the cost per step stays bounded."""
    tokens = np.asarray(token_ids[-max_search:], dtype=np.int64)
    num = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        pattern = tokens[num - n:]                                               # [n]
        windows = sliding_window_view(tokens[:num - 1], n)                       # [num - n, n]
        hits = np.nonzero((windows == pattern).all(axis=1))[0]                   # starts of earlier occurrences
        hits = hits[hits + n < num]           # something must follow the occurrence (excludes the suffix itself)
        if len(hits):
            # copy what followed; a copy that reaches the end goes on with its own tokens (a repeating
            # pattern continues its period, as an overlapping LZ77 copy does)
            start = int(hits[-1]) + n
            out = tokens[start:start + k].tolist()
            while len(out) < k:
                out.append(out[len(out) - (num - start)])
            return out
    return []
