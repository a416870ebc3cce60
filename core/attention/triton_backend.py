"""Triton attention backend (the GPU path): KV store by slot mapping, one paged-attention kernel for
mixed prefill/decode batches, split-KV for long decodes. Same results as `TorchAttentionBackend`.

Per step (not per layer) `KernelMeta` is built once from `AttentionMetadata` and reused by every
layer: per-sequence query starts/lengths, context lengths, a padded int32 block table, the
split count per sequence and the work list (seq, query block, split) of the attention grid.
Everything per sequence is vectorized (numpy on the host, one host-to-device copy); nothing
reads device memory back, so building it never synchronizes.

Split-KV policy (decode only): when the batch launches fewer work items x KV heads than
`target_programs` (default 2 x the GPU's SM count), each decode group (`meta.decode_groups`,
runs of similar context length) is split into `min(max_splits, ceil(want), ceil(group_len /
min_partition))` partitions, balanced per sequence in the kernel. Prefill chunks never split.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton

from core.attention import triton_kernels as K
from core.attention.backend import AttentionBackend
from core.attention.metadata import AttentionMetadata
from core.execution.packing import aligned_offsets, pack_aligned
from core.environment.backends import interpreting

LOG2E = 1.4426950408889634
# block_m = query rows per tile (BLOCK_Q tokens x the padded GQA group), tile_n = keys per KV tile (for
# head_dim <= 128; halved/quartered above). Picked on an H100 (bf16, 32 q / 8 kv heads, head_dim 128):
# decode tile_n 128 beat 32/64 at batch 1 (2.1 vs 1.5 TB/s at 32k context) and tied at batch >= 64 (~2.97
# TB/s, the copy ceiling); up to 32 splits (2.3 vs 2.0 TB/s at 32k, batch 1); prefill 64x64, 4 warps,
# 2 stages beat 128-row tiles and 3 stages (243 TFLOP/s at 2048 fresh tokens vs 288 for torch flash SDPA).
DECODE_CONFIG = {"block_m": 16, "tile_n": 128, "num_warps": 4, "num_stages": 2}
PREFILL_CONFIG = {"block_m": 64, "tile_n": 64, "num_warps": 4, "num_stages": 2}


@dataclass
class KernelMeta:
    q_starts: torch.Tensor      # [S] int32
    q_lens: torch.Tensor        # [S] int32
    seq_lens: torch.Tensor      # [S] int32
    block_tables: torch.Tensor  # [S, W] int32
    num_splits: torch.Tensor    # [S] int32
    work: torch.Tensor          # [3, N] int32: seq, query block, split
    num_items: int
    block_q: int
    max_splits: int             # power of two >= the largest split count (1: no split path)
    split_token_offset: int     # first decode token that splits (decodes sorted by length: usually a suffix)
    num_split_tokens: int
    # query tokens per sequence on the split path: 1 (decode) or the k+1 slots of a verification graph's rows
    # (token t belongs to sequence t // q_per_seq), read by the split reduce
    q_per_seq: int = 1
    # the prefill tile config although the step's AttentionMetadata lists no prefill (a mixed-step graph's)
    prefill_tiles: bool = False


def work_items(q_lens: np.ndarray, splits: np.ndarray, block_q: int) -> np.ndarray:
    """[3, N] int64 work list of the attention grid: (seq, query block, split) for every query block of every
    sequence and every split of it, sequence by sequence."""
    items = _ceil_div(q_lens, block_q) * splits
    num_items = int(items.sum())
    seq_of = np.repeat(np.arange(len(q_lens), dtype=np.int64), items)
    first = np.concatenate([[0], np.cumsum(items)[:-1]]) if len(q_lens) else np.zeros(0, np.int64)
    local = np.arange(num_items, dtype=np.int64) - first[seq_of]
    return np.stack([seq_of, local // splits[seq_of], local % splits[seq_of]])


def _ceil_div(a: np.ndarray | int, b: int) -> np.ndarray | int:
    return -(-a // b)


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, *, max_splits: int = 32, min_partition: int = 256, target_programs: int | None = None,
                 block_m: int | None = None, tile_n: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, upcast: bool | None = None) -> None:
        self.max_splits = max_splits
        self.splits_p2 = triton.next_power_of_2(max(1, max_splits))   # the reduce kernel's one split block
        self.min_partition = min_partition
        self.target_programs = target_programs
        self.overrides = {"block_m": block_m, "tile_n": tile_n, "num_warps": num_warps, "num_stages": num_stages}
        self.upcast = upcast   # None: fp32 dots for fp32 inputs and under the interpreter; False forces native
        self._cached: tuple[AttentionMetadata, tuple, KernelMeta] | None = None

    def config(self, has_prefill: bool, interp: bool, head_dim: int = 128) -> dict[str, int]:
        """Tile config: decode-only batches (memory-bound, 16-row tiles) vs batches with prefill chunks."""
        if interp:
            cfg = {"block_m": 16, "tile_n": 32, "num_warps": 4, "num_stages": 1}
        else:
            cfg = dict(PREFILL_CONFIG if has_prefill else DECODE_CONFIG)
            if head_dim > 128:  # keep the K/V stages in shared memory
                cfg["tile_n"] = max(16, cfg["tile_n"] * 128 // head_dim)
        cfg.update({k: v for k, v in self.overrides.items() if v is not None})
        return cfg

    # ---------------------------------------------------------------- metadata
    def _target(self, device: torch.device) -> int:
        if self.target_programs is not None:
            return self.target_programs
        if device.type == "cuda":
            return 2 * torch.cuda.get_device_properties(device).multi_processor_count
        return 0  # interpreter: never split unless asked

    def _block_q(self, max_q_len: int, g_p2: int) -> int:
        """Queries per program: 1 for decode-only steps, else the full tile. Two values only (not one per
        power of two of the longest chunk), so serving never waits on the compile of a new variant; a short
        chunk only leaves rows of its tile masked."""
        return 1 if max_q_len <= 1 else self.prefill_block_q(g_p2)

    def prefill_block_q(self, g_p2: int) -> int:
        """Queries per program of a step with prefill chunks (`g_p2`: query heads per KV head, padded to a power
        of two)."""
        block_m = max(self.config(True, interpreting())["block_m"], 16, g_p2)
        return max(1, block_m // g_p2)

    def kernel_meta(self, meta: AttentionMetadata, num_kv_heads: int, g_p2: int,
                    device: torch.device) -> KernelMeta:
        if meta.kernel_meta is not None:
            return meta.kernel_meta
        key = (num_kv_heads, g_p2, device)
        if self._cached is not None and self._cached[0] is meta and self._cached[1] == key:
            return self._cached[2]
        num_decode, bs = meta.num_decode_tokens, meta.block_size
        pre_lens = np.asarray(meta.prefill_query_lens, dtype=np.int64)
        q_lens = np.concatenate([np.ones(num_decode, np.int64), pre_lens])
        q_starts = np.concatenate([np.arange(num_decode, dtype=np.int64),
                                   np.asarray(meta.prefill_query_starts, dtype=np.int64)])
        num_seqs = len(q_lens)
        block_q = self._block_q(int(q_lens.max()) if num_seqs else 1, g_p2)
        q_blocks = _ceil_div(q_lens, block_q)

        # split-KV for decodes, per decode group (groups are sorted by context length)
        splits = np.ones(num_seqs, np.int64)
        groups = meta.decode_groups if meta.decode_groups is not None else (
            [(0, num_decode, int(meta.decode_block_tables.shape[1]))] if num_decode else [])
        base_programs = int(q_blocks.sum()) * num_kv_heads
        target = self._target(device)
        if num_decode and self.max_splits > 1 and base_programs < target:
            want = _ceil_div(target, base_programs)
            for start, end, nblocks in groups:
                n = min(self.max_splits, want, _ceil_div(nblocks * bs, self.min_partition))
                splits[start:end] = max(1, n)
        max_split = int(splits.max()) if num_seqs else 1
        split_rows = np.nonzero(splits > 1)[0]
        split_offset = int(split_rows[0]) if len(split_rows) else num_decode

        work = work_items(q_lens, splits, block_q)                                 # [3, N]
        num_items = work.shape[1]

        num_pre = len(pre_lens)
        host, offs = pack_aligned([q_starts, q_lens, splits, np.asarray(meta.prefill_context_lens, np.int64),
                                   work.reshape(-1)], np.int32)
        staged = torch.from_numpy(host)
        if device.type == "cuda":  # pinned + non_blocking: no stream sync in the middle of the forward
            staged = staged.pin_memory()
        dev = staged.to(device, non_blocking=True)
        s = num_seqs
        seq_lens = torch.cat([meta.decode_context_lens.to(device=device, dtype=torch.int32),
                              dev[offs[3]:offs[3] + num_pre]])
        width = max([int(meta.decode_block_tables.shape[1]) if num_decode else 0]
                    + [int(t.shape[0]) for t in meta.prefill_block_tables]) or 1
        tables = torch.zeros((num_seqs, width), dtype=torch.int32, device=device)
        if num_decode:
            dt = meta.decode_block_tables
            tables[:num_decode, :dt.shape[1]] = dt
        if num_pre:
            padded = torch.nn.utils.rnn.pad_sequence(list(meta.prefill_block_tables), batch_first=True)
            tables[num_decode:, :padded.shape[1]] = padded
        km = KernelMeta(
            q_starts=dev[:s], q_lens=dev[offs[1]:offs[1] + s], num_splits=dev[offs[2]:offs[2] + s], seq_lens=seq_lens,
            block_tables=tables, work=dev[offs[4]:offs[4] + 3 * num_items].view(3, num_items), num_items=num_items,
            block_q=block_q, max_splits=triton.next_power_of_2(max_split), split_token_offset=split_offset,
            num_split_tokens=num_decode - split_offset)
        self._cached = (meta, key, km)
        return km

    # ---------------------------------------------------------------- CUDA-graph decode
    def graph_max_splits(self, batch_size: int, num_kv_heads: int, device: torch.device) -> int:
        """Split cap (power of two) of a decode graph captured for `batch_size` sequences: the most any
        step of that size can ask for under the split policy."""
        base = batch_size * num_kv_heads
        target = self._target(device)
        if self.max_splits <= 1 or base >= target:
            return 1
        return triton.next_power_of_2(min(self.max_splits, _ceil_div(target, base)))

    def graph_decode_splits(self, context_lens: np.ndarray, groups: list[tuple[int, int, int]], batch_size: int,
                            num_kv_heads: int, cap: int, block_size: int, device: torch.device) -> np.ndarray:
        """Per-sequence split counts of a padded decode batch (same policy as `kernel_meta`), <= cap."""
        splits = np.ones(len(context_lens), np.int64)
        if cap > 1:
            want = _ceil_div(self._target(device), batch_size * num_kv_heads)
            for start, end, nblocks in groups:
                splits[start:end] = max(1, min(cap, want, _ceil_div(nblocks * block_size, self.min_partition)))
        return splits

    @staticmethod
    def graph_kernel_meta(batch_size: int, cap: int, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                          num_splits: torch.Tensor, q_lens: torch.Tensor | None = None,
                          q_per_seq: int = 1) -> KernelMeta:
        """Kernel metadata over persistent buffers for a decode batch of `batch_size` (padded) sequences:
        the work list holds every (seq, split < cap); items past a sequence's split count exit at once.

        Verification-shaped (`q_per_seq` = k+1 > 1): sequence i owns the query tokens [i*q, (i+1)*q), of which
        the first `q_lens[i]` (a persistent buffer, refilled each step) are real; one query block covers them
        all (BLOCK_Q = the next power of two), so the grid is the decode grid of the same batch size."""
        device = seq_lens.device
        ar = torch.arange(batch_size * cap, dtype=torch.int32, device=device)
        work = torch.stack([ar // cap, torch.zeros_like(ar), ar % cap])      # [3, B * cap]
        seqs = torch.arange(batch_size, dtype=torch.int32, device=device)
        if q_per_seq > 1:
            assert q_lens is not None and q_lens.shape == (batch_size,)
        else:
            q_lens = torch.ones_like(seqs)
        num_tokens = batch_size * q_per_seq
        return KernelMeta(q_starts=seqs * q_per_seq, q_lens=q_lens, seq_lens=seq_lens, block_tables=block_tables,
                          num_splits=num_splits, work=work, num_items=batch_size * cap,
                          block_q=triton.next_power_of_2(q_per_seq), max_splits=cap, split_token_offset=0,
                          num_split_tokens=num_tokens if cap > 1 else 0, q_per_seq=q_per_seq)

    # ---------------------------------------------------------------- kernels
    @staticmethod
    def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        num_tokens, num_kv_heads, head_dim = k.shape
        if num_tokens == 0:
            return
        k = k if k.stride(2) == 1 and k.stride(1) == head_dim else k.contiguous()
        v = v if v.stride(2) == 1 and v.stride(1) == head_dim else v.contiguous()
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        row = num_kv_heads * head_dim
        K.store_kv_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
            ROW=row, BLOCK=triton.next_power_of_2(row), num_warps=4 if row >= 1024 else 1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        self.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty_like(q)
        if num_tokens == 0:
            return out
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        head_dim_p2 = max(16, triton.next_power_of_2(head_dim))   # the kernel's width (96 -> 128, masked)
        d_real = head_dim if head_dim_p2 != head_dim else 0
        assert k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride()
        if q.stride(2) != 1:
            q = q.contiguous()
        g = num_heads // num_kv_heads
        g_p2 = triton.next_power_of_2(g)
        km = self.kernel_meta(meta, num_kv_heads, g_p2, q.device)
        block_m = km.block_q * g_p2
        has_splits = km.max_splits > 1
        if has_splits:
            rows = km.num_split_tokens * num_heads * km.max_splits    # one allocation: acc | max | sum
            offs = aligned_offsets([rows * head_dim_p2, rows, rows], 4)  # 16-byte aligned: one kernel variant
            buf = torch.empty(offs[-1], dtype=torch.float32, device=q.device)
            part_out, part_m, part_l = (buf[offs[i]:offs[i] + n]
                                        for i, n in enumerate((rows * head_dim_p2, rows, rows)))
        else:
            part_m = part_l = part_out = out  # never touched
        interp = interpreting()
        upcast = (interp or q.dtype == torch.float32) if self.upcast is None else self.upcast
        cfg = self.config(meta.num_prefills > 0 or km.prefill_tiles, interp, head_dim_p2)
        K.paged_attention_kernel[(km.num_items, num_kv_heads)](
            out, q, k_cache, v_cache, km.block_tables, km.seq_lens, km.q_starts, km.q_lens, km.num_splits,
            km.work, part_out, part_m, part_l, km.num_items, km.split_token_offset, km.max_splits,
            scale * LOG2E if softcap is None else scale / softcap, (softcap or 1.0) * LOG2E, window or 0,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), km.block_tables.stride(0),
            NUM_HEADS=num_heads, G=g, G_P2=g_p2, BLOCK_Q=km.block_q, BLOCK_M=block_m, TILE_N=cfg["tile_n"],
            BLOCK_SIZE=block_size, HEAD_DIM=head_dim_p2, HAS_SPLITS=has_splits,
            UPCAST=upcast, HAS_WINDOW=window is not None, SOFTCAP=softcap is not None, D_REAL=d_real,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        if has_splits and km.num_split_tokens:
            K.reduce_splits_kernel[(km.num_split_tokens, num_heads)](
                out, part_out, part_m, part_l, km.num_splits, km.split_token_offset, km.max_splits,
                out.stride(0), out.stride(1),
                NUM_HEADS=num_heads, HEAD_DIM=head_dim_p2, SPLITS_P2=max(km.max_splits, self.splits_p2),
                Q_PER_SEQ=km.q_per_seq, D_REAL=d_real, num_warps=4)
        return out

