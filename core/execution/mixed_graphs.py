"""CUDA graphs for mixed steps: decode rows and prefill chunks in one replay, one graph per padded token count.

Why: an eager step pays the launch cost of every kernel of the forward on the host. On an H200 with the 8B
shape that was ~20 ms for the base model and ~50 ms with the 32-adapter mix (the LoRA launches of 32 layers),
whatever the chunk, against 6-21 ms for a decode graph's replay: every step that carried a prefill chunk
stretched the gap of each decoding request to 3-8x its median (`benchmarks/results/gpu_run_h200_2026-11-26b/`,
the step trace). A graph replays the same kernels with no host work between them.

Layout of a step of T tokens in the graph of size P >= T (the smallest captured size that holds it): the flat
tokens in the eager order (decode rows, then each prefill chunk), then P - T padding tokens. The padding is one
more sequence (query and context length P - T, block table row of zeros, KV slot -1: nothing is written to the
cache, and it reads finite values from block 0) so every row of the forward holds finite numbers; its output
is dropped. The attention grid is fixed per size: a work list of P items (every item covers at least one
token), the step's items first (`work_items`, query blocks of the prefill tile, no split-KV), the rest on an
empty sequence (query and context length 0: the program returns at once). LoRA rows go through the BGMV
kernels with one slot per token (`GraphLoRABuffers`, -1 for base and padding), as in the decode graphs: an
adapter's tokens in groups of at most 16, one program each, so a prefill chunk on an adapter is as many programs
side by side (`bgmv.decode_groups`; as one group per adapter, one program walked a 500-1,000-token chunk in turn
and such steps took 340-1,120 ms on an H200, `benchmarks/results/gpu_run_h200_2026-11-26b/`).

Steps run here when they carry prefill chunks, no speculative drafts and at most the largest size of tokens; the
others run as before (decode and verification graphs, or eagerly). `use_graphs=False` runs the same padded path
without capturing (the CPU tests under TRITON_INTERPRET). Built at one tensor-parallel rank only (the workers
build no such runner). LORAPLEX_MIXED_GRAPHS=0 turns them off.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np
import torch
import triton

from adapters.lora_ops.backends import OVERLAP_MAX_TOKENS, LoRABackends
from adapters.lora_ops.graph_meta import GraphLoRABuffers
from core.attention.metadata import AttentionMetadata
from core.attention.triton_backend import KernelMeta, TritonAttentionBackend, work_items
from core.environment import variables as env
from core.execution.runner import HostBatch
from core.execution.staging import Staging

log = logging.getLogger("loraplex.mixed_graphs")
# padded token counts: fine steps where the padding costs compute (past ~200 tokens on an H100/H200 a step's
# GEMMs are arithmetic-bound), none past 1024 (larger steps are prefill-heavy: their launch cost is a small share)
MIXED_GRAPH_SIZES = (32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024)
MEMORY_MARGIN_BYTES = 256 << 20      # device memory left free beside the largest mixed-step graph's activations


def _align4(n: int) -> int:
    return -(-n // 4) * 4                    # int32 fields start 16-byte aligned: the warm-up's kernel variants


class MixedGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 backend: TritonAttentionBackend, block_size: int, max_model_len: int, sizes: tuple[int, ...],
                 lora: GraphLoRABuffers | None = None, lora_context: Any = None, use_graphs: bool = True) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.block_size = block_size
        self.sizes = tuple(sorted(sizes))
        self.max_tokens = t = self.sizes[-1]
        self.lora, self.lora_context = lora, lora_context
        assert lora is None or lora.max_batch_size >= t, "LoRA graph buffers too short"
        self.use_graphs = use_graphs
        self.device = kv_caches[0][0].device
        g_p2 = triton.next_power_of_2(model.config.num_heads // model.config.num_kv_heads)   # one rank: unsharded
        self.block_q = backend.prefill_block_q(g_p2)
        # block table columns: the model's longest sequence, and at least the padding sequence's P - T keys
        self.width = w = -(-max(max_model_len, t) // block_size)
        # sequences: the step's (each holds >= 1 token, so <= T), the padding one and the empty one
        self.max_seqs = s = _align4(t + 2)
        # int64 [3T]: ids | positions | slots
        # int32 [3S + 3T + S*W]: query starts | query lens | context lens | work [3, T] | block tables [S, W]
        self.off_work, self.off_tables = 3 * s, 3 * s + 3 * t
        self.staging = Staging([torch.int64, torch.int32], [3 * t, self.off_tables + s * w], self.device)
        self.dev64 = torch.zeros(3 * t, dtype=torch.int64, device=self.device)
        self.dev32 = torch.zeros(self.off_tables + s * w, dtype=torch.int32, device=self.device)
        self.kernel_metas = {p: self._kernel_meta(p) for p in self.sizes}
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_runs = 0          # steps through this runner (replayed or, without graphs, padded eager)
        self.num_padding_tokens = 0
        self.capture_s = 0.0

    def _kernel_meta(self, size: int) -> KernelMeta:
        s, d = self.max_seqs, self.dev32
        return KernelMeta(q_starts=d[:s], q_lens=d[s:2 * s], seq_lens=d[2 * s:3 * s], num_splits=d[s:2 * s],
                          block_tables=d[self.off_tables:].view(s, self.width),                      # [S, W]
                          work=d[self.off_work:self.off_work + 3 * size].view(3, size), num_items=size,
                          block_q=self.block_q, max_splits=1, split_token_offset=0, num_split_tokens=0,
                          prefill_tiles=True)

    # ---------------------------------------------------------------- selection
    def padded_size(self, num_tokens: int) -> int | None:
        return next((p for p in self.sizes if p >= num_tokens), None)

    def can_run(self, host: HostBatch) -> bool:
        """A step with prefill chunks and no drafts, of at most the largest size of tokens."""
        if host.decode_only or self.padded_size(host.num_tokens) is None:
            return False
        return not any(r.num_spec_tokens for r in host.requests)

    # ---------------------------------------------------------------- inputs
    def _fill(self, host: HostBatch | None, size: int) -> None:
        """Writes a step's inputs (None: padding only, a capture's) into the staging buffers; copies them."""
        s, t, w = self.max_seqs, self.max_tokens, self.width
        h64, h32 = self.staging.next()
        n = 0 if host is None else len(host.requests)
        num_tokens = 0 if host is None else host.num_tokens
        pad = size - num_tokens
        h64[:t], h64[t:2 * t], h64[2 * t:3 * t] = 0, 0, -1
        q_starts, q_lens, ctx = h32[:s], h32[s:2 * s], h32[2 * s:3 * s]
        if host is not None:
            h64[:num_tokens], h64[t:t + num_tokens] = host.token_ids, host.positions
            h64[2 * t:2 * t + num_tokens] = host.slot_mapping
            q_starts[:n], q_lens[:n], ctx[:n] = host.cu[:-1], host.num_new, host.context_lens
        q_starts[n:n + 2], q_lens[n:n + 2], ctx[n:n + 2] = (num_tokens, 0), (pad, 0), (pad, 0)
        lens = q_lens[:n + 1].astype(np.int64)
        work = work_items(lens, np.ones(n + 1, np.int64), self.block_q)                  # [3, N]
        assert work.shape[1] <= size, "more attention items than tokens"
        items = h32[self.off_work:self.off_work + 3 * size].reshape(3, size)             # [3, size]
        items[:] = 0
        items[0] = n + 1                                                                  # the empty sequence
        items[:, :work.shape[1]] = work
        tables = h32[self.off_tables:self.off_tables + (n + 2) * w].reshape(n + 2, w)    # [n + 2, W]
        tables[n:] = 0              # the step's rows keep stale columns past their blocks: never read
        if host is not None:
            cols = min(w, host.tables.shape[1])
            tables[:n, :cols] = host.tables[:, :cols]
        self.staging.copy_to([self.dev64, self.dev32], [3 * t, self.off_tables + (n + 2) * w])

    def check_integrity(self, host: HostBatch, size: int) -> None:
        """The device buffers of the last fill (`host` in a graph of `size`): every token of the step and of the
        padding is the query of exactly one work item; the step's rows are its tokens, positions and slots;
        the padding writes no KV; items past the step's are on the empty sequence."""
        s, t = self.max_seqs, self.max_tokens
        ids, pos, slots = (self.dev64[i * t:i * t + size].cpu().numpy() for i in range(3))
        d32 = self.dev32.cpu().numpy()
        q_starts, q_lens, ctx = d32[:s], d32[s:2 * s], d32[2 * s:3 * s]
        work = d32[self.off_work:self.off_work + 3 * size].reshape(3, size)                 # [3, size]
        n, num_tokens = len(host.requests), host.num_tokens
        known = host.token_ids >= 0                     # tokens still in flight are patched on the device
        assert (ids[:num_tokens][known] == host.token_ids[known]).all() and (pos[:num_tokens] == host.positions).all()
        assert (slots[:num_tokens] == host.slot_mapping).all() and (slots[num_tokens:] == -1).all()
        assert q_lens[n] == ctx[n] == size - num_tokens and q_starts[n] == num_tokens
        assert q_lens[n + 1] == ctx[n + 1] == 0
        assert (ctx[:n] == host.context_lens).all() and (ctx[:n + 1] >= q_lens[:n + 1]).all()
        covered = np.zeros(size, np.int64)
        for seq, q_block, split in work.T:
            assert 0 <= seq <= n + 1 and split == 0
            first = q_block * self.block_q
            if seq == n + 1:
                continue
            assert first < q_lens[seq], "an item past its sequence's queries"
            last = min(first + self.block_q, q_lens[seq])
            covered[q_starts[seq] + first:q_starts[seq] + last] += 1
        assert (covered == 1).all(), "a token with no work item, or with two"
        tables = d32[self.off_tables:self.off_tables + (n + 2) * self.width].reshape(n + 2, self.width)
        assert (tables[n:] == 0).all()

    def _meta(self, size: int) -> AttentionMetadata:
        t = self.max_tokens
        km = self.kernel_metas[size]
        return AttentionMetadata(
            slot_mapping=self.dev64[2 * t:2 * t + size], num_decode_tokens=0, decode_block_tables=km.block_tables,
            decode_context_lens=km.seq_lens, prefill_query_starts=[], prefill_query_lens=[], prefill_context_lens=[],
            prefill_block_tables=[], block_size=self.block_size, decode_groups=[], kernel_meta=km)

    def _forward(self, size: int) -> torch.Tensor:
        t = self.max_tokens
        # fresh views every call: the rotary table lookup is memoized per positions tensor object
        return self.model(self.dev64[:size], self.dev64[t:t + size], self.kv_caches, self._meta(size))  # [P, hidden]

    def _set_lora(self, token_slots: np.ndarray | None, size: int) -> bool:
        if self.lora is None or token_slots is None or not (token_slots >= 0).any():
            self.lora_context is not None and self.lora_context.clear()
            return False
        self.lora.fill(token_slots, size)
        self.lora_context.set_meta(self.lora.meta(size))
        return True

    # ---------------------------------------------------------------- capture / run
    def _capture_shapes(self) -> list[tuple[int, bool]]:
        loras = (False, True) if self.lora is not None else (False,)
        return [(p, lo) for p in sorted(self.sizes, reverse=True) for lo in loras]

    def _prime(self, size: int, with_lora: bool) -> None:
        self._fill(None, size)
        self._set_lora(np.zeros(size, np.int64) - 1 + (1 if with_lora else 0), size)

    def capture(self, pool: Any = None) -> int:
        """Captures every size with and without LoRA (largest first, in `pool`: the decode graphs' memory pool, as
        no two graphs run at once); returns the number of graphs. Without graphs it runs each forward once."""
        start = time.monotonic()
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
            pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        for size, with_lora in self._capture_shapes():
            self._prime(size, with_lora)
            out = self._forward(size)                                 # warm-up (kernels compiled by now)
            if self.use_graphs:
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(size)
                self.graphs[(size, with_lora)] = (graph, out)
            if self.lora_context is not None:
                self.lora_context.clear()
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
        self.capture_s = time.monotonic() - start
        log.info("mixed-step graphs: %d sizes %s%s in %.1f s", len(self.sizes), list(self.sizes),
                 ", with and without LoRA" if self.lora is not None else "", self.capture_s)
        return len(self._capture_shapes())

    def run(self, host: HostBatch, token_slots: np.ndarray | None,
            on_inputs: Any = None) -> torch.Tensor:
        """[T, hidden] in flat token order for a step `can_run` accepted (`token_slots`: per-token LoRA slot, -1 =
        base). `on_inputs(input_ids)` may rewrite the device ids of the step's tokens (tokens still in flight)."""
        num_tokens = host.num_tokens
        size = self.padded_size(num_tokens)
        assert size is not None
        self._fill(host, size)
        if on_inputs is not None:
            on_inputs(self.dev64[:num_tokens])
        with_lora = self._set_lora(token_slots, size)
        self.num_runs += 1
        self.num_padding_tokens += size - num_tokens
        try:
            if self.use_graphs:
                graph, out = self.graphs[(size, with_lora)]
                graph.replay()
            else:
                out = self._forward(size)
            return out[:num_tokens]
        finally:
            if self.lora_context is not None:
                self.lora_context.clear()


def activation_bytes_per_token(cfg: Any, dtype: torch.dtype, lora_overlap: bool = False) -> int:
    """A generous bound on what one token of a forward keeps alive at once (the residual stream and its norms, the
    q/k/v and attention rows, the MLP's gate, up and product; with `lora_overlap`, the float32 LoRA delta of the
    widest fused linear, gate/up, beside them: adapters/lora_ops/bgmv_overlap.py): a graph's memory pool grows with
    its token count."""
    elt = torch.empty(0, dtype=dtype).element_size()
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    delta = 4 * max(2 * cfg.intermediate_size, qkv) if lora_overlap else 0
    return elt * (6 * cfg.hidden_size + 3 * cfg.intermediate_size + 2 * qkv) + delta


def graph_bytes_per_token(cfg: Any, dtype: torch.dtype, backends: LoRABackends | None, size: int) -> int:
    """`activation_bytes_per_token` of a mixed-step graph of `size` tokens: with the LoRA delta only where such a
    step computes it (`LoRABackends.overlaps`: the Triton decode path, at most OVERLAP_MAX_TOKENS rows)."""
    overlap = backends is not None and backends.decode_overlap and size <= OVERLAP_MAX_TOKENS
    return activation_bytes_per_token(cfg, dtype, overlap)


def sizes_that_fit(sizes: tuple[int, ...], per_token: int | Callable[[int], int], free_bytes: int,
                   margin: int = MEMORY_MARGIN_BYTES) -> tuple[int, ...]:
    """The sizes whose activations fit in the device memory left after the KV pool and the decode graphs
    (`per_token`: the bytes a token keeps alive, or a function of the size giving them)."""
    of = per_token if callable(per_token) else (lambda _size: per_token)
    return tuple(p for p in sizes if p * of(p) <= free_bytes - margin)


def build_mixed_graphs(config: Any, parts: Any, decode_backend: Any) -> MixedGraphRunner | None:
    """The mixed-step graph runner next to the decode graphs (`decode_backend`: the model's TritonAttentionBackend,
    None when the decode graphs were not built), at one rank only, with the sizes the free device memory holds;
    None when turned off or when none fits."""
    if decode_backend is None or not env.MIXED_GRAPHS.get() or config.parallel.tensor_parallel_size > 1:
        return None
    wanted = tuple(p for p in MIXED_GRAPH_SIZES if p <= config.scheduler.max_num_batched_tokens) or \
        (MIXED_GRAPH_SIZES[0],)
    free = torch.cuda.mem_get_info(parts.device)[0] if parts.device.type == "cuda" else 1 << 62
    backends = parts.lora_pool.context.backends if parts.lora_pool is not None else None
    sizes = sizes_that_fit(wanted, lambda p: graph_bytes_per_token(parts.model.config, parts.dtype, backends, p), free)
    if sizes != wanted:
        log.warning("mixed-step graphs: %.0f MiB of device memory free after the KV pool and the decode graphs "
                    "hold sizes up to %s of %s tokens; larger steps with prefill run eagerly (lower "
                    "--gpu-memory-utilization for more)", free / 2 ** 20, max(sizes, default=0), max(wanted))
    if not sizes:
        return None
    lora = None
    if parts.lora_pool is not None:
        lora = GraphLoRABuffers(max(sizes), parts.lora_pool.num_slots, parts.device)
    return MixedGraphRunner(parts.model, parts.kv_caches, decode_backend, config.cache.block_size,
                            parts.max_model_len, sizes, lora=lora,
                            lora_context=parts.lora_pool.context if lora else None)
