"""Builds the flat batch of one step (input ids, positions, slot mapping, block tables) and runs the model.

Layout: requests with one new token (decodes) first, then prefill chunks, each contiguous.
Everything per token is computed with numpy vector ops on the host (`prepare_batch`); `to_device`
then moves it with pinned, non-blocking copies, so building a batch never waits for the GPU.
The CUDA-graph decode path (`core/execution/cuda_graphs.py`) takes the host batch directly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from core.attention.metadata import AttentionMetadata
from core.execution.packing import pack_aligned
from core.engine.request import Request


@dataclass
class HostBatch:
    """One step's flat batch on the host (numpy)."""
    requests: list[Request]               # batch order: decodes (by context length), then prefills
    num_new: np.ndarray                   # [B] int64
    cu: np.ndarray                        # [B + 1] int64: flat token offsets
    token_ids: np.ndarray                 # [T] int64
    positions: np.ndarray                 # [T] int64 rope table rows: the position (+ the longrope offset)
    slot_mapping: np.ndarray              # [T] int64
    tables: np.ndarray                    # [B, max_blocks] int64 (padded with 0)
    context_lens: np.ndarray              # [B] int64: cached + new tokens
    num_decode: int
    samples: list[int]                    # batch rows that sample a token this step

    @property
    def num_tokens(self) -> int:
        return int(self.cu[-1])

    @property
    def decode_only(self) -> bool:
        return self.num_decode == len(self.requests)


@dataclass
class ModelInput:
    input_ids: torch.Tensor               # [T]
    positions: torch.Tensor               # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor          # [N] row of each sampled request's last token


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


def prepare_batch(scheduled: list[tuple[Request, int]], block_size: int) -> HostBatch:
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
    rope_offsets = np.fromiter((r.rope_offset for r in reqs), dtype=np.int64, count=len(reqs))
    if rope_offsets.any():  # longrope requests admitted with the long factors read the second rope table
        positions = positions + rope_offsets[seq_of_token]
    samples = [i for i, r in enumerate(reqs) if r.num_computed_tokens + int(num_new[i]) == r.num_tokens]
    return HostBatch(requests=reqs, num_new=num_new, cu=cu, token_ids=np.asarray(token_ids, dtype=np.int64),
                     positions=positions, slot_mapping=slot_mapping, tables=tables, context_lens=starts + num_new,
                     num_decode=len(decodes), samples=samples)


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array -> device tensor; pinned + non_blocking on CUDA (a pageable copy would sync the stream)."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t if device.type == "cpu" else t.to(device)


def sample_rows(host: HostBatch, graph: bool) -> np.ndarray | None:
    """The rows of a step's forward output that sample, on the host (None: all of them). Eager, mixed-step and
    verification graph output is in flat token order: the last flat token of each sampled row. A decode graph's
    output has a row per request: its sampled rows (None when every row samples)."""
    if not (graph and host.decode_only):
        return host.cu[1:][host.samples] - 1
    if len(host.samples) == len(host.requests):
        return None
    return np.asarray(host.samples, dtype=np.int64)


def graph_sample_rows(host: HostBatch, device: torch.device) -> torch.Tensor | None:
    """`sample_rows` of a graph runner's output (decode, verification or mixed-step graph) on `device`."""
    rows = sample_rows(host, graph=True)
    return None if rows is None else host_to_device(rows, device)


def to_device(host: HostBatch, block_size: int, device: torch.device) -> ModelInput:
    num_decode = host.num_decode
    ctx, tables = host.context_lens, host.tables
    decode_blocks = int(-(-ctx[:num_decode].max() // block_size)) if num_decode else 0
    pre_blocks = [-(-int(c) // block_size) for c in ctx[num_decode:]]
    # one copy for all per-token int64 data: ids | positions | slots | logits rows | decode lens (aligned)
    logits_rows = sample_rows(host, graph=False)
    packed_host, offs = pack_aligned([host.token_ids, host.positions, host.slot_mapping, logits_rows,
                                      ctx[:num_decode]], np.int64)
    packed = host_to_device(packed_host, device)
    t, n = host.num_tokens, len(host.samples)
    dtables = host_to_device(tables[:num_decode, :decode_blocks], device)
    meta = AttentionMetadata(
        slot_mapping=packed[offs[2]:offs[2] + t],
        num_decode_tokens=num_decode,
        decode_block_tables=dtables,
        decode_context_lens=packed[offs[4]:offs[4] + num_decode],
        decode_groups=decode_groups(ctx[:num_decode], block_size),
        prefill_query_starts=host.cu[num_decode:-1].tolist(),
        prefill_query_lens=host.num_new[num_decode:].tolist(),
        prefill_context_lens=ctx[num_decode:].tolist(),
        prefill_block_tables=[host_to_device(tables[num_decode + i, :nb], device) for i, nb in enumerate(pre_blocks)],
        block_size=block_size,
    )
    return ModelInput(
        input_ids=packed[:t],
        positions=packed[offs[1]:offs[1] + t],
        meta=meta,
        logits_indices=packed[offs[3]:offs[3] + n],
    )
