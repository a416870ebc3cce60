"""Builds the flat batch of one step (input ids, positions, slot mapping, block tables) and runs the model.

Layout: requests with one new token (decodes) first, then prefill chunks, each contiguous.
Everything per token is computed with numpy/torch vector ops; Python loops run per request only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from core.attention.metadata import AttentionMetadata
from core.request import Request


@dataclass
class ModelInput:
    input_ids: torch.Tensor               # [T]
    positions: torch.Tensor               # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor          # [N] row of each sampled request's last token
    requests: list[Request]               # batch order
    num_new_tokens: list[int]             # batch order
    sample_requests: list[Request]        # requests that sample a token this step, in logits order
    token_starts: list[int]               # first flat index of each request


def decode_groups(context_lens: np.ndarray, block_size: int, max_ratio: float = 1.5,
                  min_size: int = 8) -> list[tuple[int, int, int]]:
    """Splits decodes (sorted by context length) into runs of similar length: (start, end, num_blocks)."""
    groups: list[tuple[int, int, int]] = []
    start = 0
    num = len(context_lens)
    for i in range(1, num + 1):
        if i == num or (i - start >= min_size and context_lens[i] > max_ratio * context_lens[start]):
            groups.append((start, i, int(-(-int(context_lens[i - 1]) // block_size))))
            start = i
    return groups


def build_model_input(scheduled: list[tuple[Request, int]], block_size: int,
                      device: torch.device) -> ModelInput:
    # decodes sorted by context length so the attention backend can group similar lengths (less padding)
    decodes = sorted(((r, n) for r, n in scheduled if n == 1), key=lambda e: e[0].num_computed_tokens)
    prefills = [(r, n) for r, n in scheduled if n > 1]
    ordered = decodes + prefills
    reqs = [r for r, _ in ordered]
    num_new = np.fromiter((n for _, n in ordered), dtype=np.int64, count=len(ordered))
    starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=len(reqs))
    cu = np.zeros(len(reqs) + 1, dtype=np.int64)
    np.cumsum(num_new, out=cu[1:])
    num_tokens = int(cu[-1])

    token_ids: list[int] = []
    for r, n in ordered:
        c = r.num_computed_tokens
        if n == 1:
            token_ids.append(r.all_token_ids[c])
        else:
            token_ids.extend(r.all_token_ids[c:c + n])

    seq_of_token = np.repeat(np.arange(len(reqs)), num_new)                    # [T]
    positions = np.arange(num_tokens, dtype=np.int64) - cu[:-1][seq_of_token] + starts[seq_of_token]
    max_blocks = max(len(r.block_ids) for r in reqs)
    tables = np.zeros((len(reqs), max_blocks), dtype=np.int64)                 # [B, max_blocks]
    for i, r in enumerate(reqs):
        tables[i, :len(r.block_ids)] = r.block_ids
    slot_mapping = tables[seq_of_token, positions // block_size] * block_size + positions % block_size

    num_decode = len(decodes)
    context_lens = starts + num_new
    decode_blocks = int(-(-context_lens[:num_decode].max() // block_size)) if num_decode else 0
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        num_decode_tokens=num_decode,
        decode_block_tables=torch.from_numpy(tables[:num_decode, :decode_blocks].copy()).to(device),
        decode_context_lens=torch.from_numpy(context_lens[:num_decode].copy()).to(device),
        decode_groups=decode_groups(context_lens[:num_decode], block_size),
        prefill_query_starts=cu[num_decode:-1].tolist(),
        prefill_query_lens=num_new[num_decode:].tolist(),
        prefill_context_lens=context_lens[num_decode:].tolist(),
        prefill_block_tables=[torch.tensor(r.block_ids[:-(-int(c) // block_size)], dtype=torch.int64, device=device)
                              for r, c in zip(reqs[num_decode:], context_lens[num_decode:])],
        block_size=block_size,
    )
    samples = [i for i, r in enumerate(reqs) if r.num_computed_tokens + int(num_new[i]) == r.num_tokens]
    return ModelInput(
        input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        positions=torch.from_numpy(positions).to(device),
        meta=meta,
        logits_indices=torch.from_numpy(cu[1:][samples] - 1).to(device),
        requests=reqs,
        num_new_tokens=num_new.tolist(),
        sample_requests=[reqs[i] for i in samples],
        token_starts=cu[:-1].tolist(),
    )
