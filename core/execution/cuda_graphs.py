"""CUDA graphs for decode and verification steps: one graph per (padded batch size, query slots per row, LoRA
on/off), replayed over persistent buffers.

A decode-only step of n requests runs the graph of the smallest captured size B >= n. Its inputs (ids,
positions, slot mapping, context lengths, split counts, block tables; LoRA tiles when adapters are in the
batch) are written on the host into pinned staging buffers and reach the device with one non-blocking copy
per buffer, then the graph replays every kernel of the forward with no Python in between. Padded rows have
slot -1 (the KV store skips them), context length 1 and block table row 0; their outputs are dropped.

A speculative verification step (rows with drafts carry 1 + k_i <= k+1 query tokens, the others one) runs the
verification graph of its padded size: row i owns the token slots [i*(k+1), (i+1)*(k+1)) of the same buffers
(query length, ids, positions, slots; the unused slots of a row are padding: slot -1, position 0, never a
query of the attention kernel), the attention kernel reads one query block of k+1 rows per sequence
(`TritonAttentionBackend.graph_kernel_meta(q_per_seq=k+1)`) and the LoRA kernels one row per token slot. Its
output, [B*(k+1), hidden], is gathered back into the step's flat token order (a gather index filled with the
inputs), so the verification and the sampling read it as they read an eager forward's. Verification graphs
exist for the decode sizes up to 32 rows (or up to `disable_by_batch_size` when that is larger). Steps with
prefill chunks, with tokens still in flight, or with more rows than the largest size of their kind run eagerly.

`use_graphs=False` runs the same padded path without capturing (tests on the CPU, under TRITON_INTERPRET): the
same buffers at their maximum shape, so their shapes and data pointers do not change from step to step.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np
import torch

from core.attention.metadata import AttentionMetadata
from core.kv.pool_size import CUDA_GRAPH_RESERVE_BYTES
from core.execution.runner import HostBatch, decode_groups
from core.execution.staging import Staging
from adapters.lora_ops.graph_meta import GraphLoRABuffers

log = logging.getLogger("loraplex.cuda_graphs")
VERIFY_MAX_BATCH_SIZE = 32      # verification graphs at least up to this batch size


def default_capture_sizes(max_num_seqs: int, limit: int = 256) -> tuple[int, ...]:
    ladder = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    top = min(max_num_seqs, limit)
    sizes = [b for b in ladder if b < top] + [top]
    return tuple(sorted(set(sizes)))


def verify_capture_sizes(sizes: tuple[int, ...], disable_by_batch_size: int | None) -> tuple[int, ...]:
    """The decode sizes that get a verification graph: up to 32 rows, or up to the smallest size that holds
    `disable_by_batch_size` rows when that is larger (speculation is meant for the batches below it). Larger
    steps with drafts run eagerly."""
    top = VERIFY_MAX_BATCH_SIZE if disable_by_batch_size is None else max(VERIFY_MAX_BATCH_SIZE,
                                                                           disable_by_batch_size)
    cover = next((s for s in sorted(sizes) if s >= top), max(sizes))
    return tuple(s for s in sorted(sizes) if s <= cover)


def graph_num_tokens(sizes: tuple[int, ...], verify_len: int, verify_sizes: tuple[int, ...]) -> int:
    """Token rows of the largest graph: the persistent buffers' (and the graph LoRA buffers') length."""
    return max(max(sizes), max(verify_sizes, default=0) * verify_len if verify_len > 1 else 0)


def graph_token_index(host: HostBatch, q: int) -> np.ndarray:
    """[T] the slot of each flat token of `host` in a graph of `q` query slots per row: row i, token j ->
    i*q + j."""
    row_of = np.repeat(np.arange(len(host.requests), dtype=np.int64), host.num_new)          # [T]
    return row_of * q + np.arange(host.num_tokens, dtype=np.int64) - host.cu[:-1][row_of]


class DecodeGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: Any,
                 block_size: int, max_model_len: int, capture_sizes: tuple[int, ...], lora: Any = None,
                 lora_context: Any = None, use_graphs: bool = True, verify_len: int = 0,
                 verify_sizes: tuple[int, ...] = ()) -> None:
        """`backend`: the model's TritonAttentionBackend; `lora`: GraphLoRABuffers (None: no adapters) of at
        least `graph_num_tokens(...)` rows; `verify_len`: k+1, the query slots per row of a verification graph
        (0: no verification graphs), captured for `verify_sizes` (a subset of `capture_sizes`)."""
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.block_size = block_size
        self.sizes = tuple(sorted(capture_sizes))
        self.max_batch_size = self.sizes[-1]
        self.verify_len = verify_len if verify_len > 1 else 0
        self.verify_sizes = tuple(sorted(verify_sizes)) if self.verify_len else ()
        assert set(self.verify_sizes) <= set(self.sizes), "verification sizes are decode sizes"
        self.max_tokens = graph_num_tokens(self.sizes, self.verify_len, self.verify_sizes)
        self.lora, self.lora_context = lora, lora_context
        assert lora is None or lora.max_batch_size >= self.max_tokens, "LoRA graph buffers too short"
        self.use_graphs = use_graphs
        k_cache = kv_caches[0][0]
        self.device = k_cache.device
        self.num_kv_heads = k_cache.shape[2]
        self.width = -(-max_model_len // block_size)                    # block table columns
        b, w, t = self.max_batch_size, self.width, self.max_tokens
        # int64 [4T]: ids | positions | slots | gather (verification: graph slot of each flat token)
        # int32 [3B + B*W]: seq lens | split counts | query lens | block tables [B, W]
        self.staging = Staging([torch.int64, torch.int32], [4 * t, 3 * b + b * w], self.device)
        self.dev64 = torch.zeros(4 * t, dtype=torch.int64, device=self.device)
        self.dev32 = torch.zeros(3 * b + b * w, dtype=torch.int32, device=self.device)
        self.caps = {s: backend.graph_max_splits(s, self.num_kv_heads, self.device) for s in self.sizes}
        self.kernel_metas = {(s, q): backend.graph_kernel_meta(
            s, self.caps[s], self.dev32[:s], self.dev32[3 * b:3 * b + s * w].view(s, w), self.dev32[b:b + s],
            q_lens=self.dev32[2 * b:2 * b + s] if q > 1 else None, q_per_seq=q)
            for s, q in self.shapes()}
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0      # graph replays
        self.num_runs = 0         # steps through this runner (replayed or, without graphs, eager)
        self.num_fallbacks = 0    # decode-only steps with more rows than the largest graph (run eagerly)
        self.num_verify_steps = 0  # steps with speculative drafts (graph or eager)
        self.num_verify_runs = 0   # of those, the ones through a verification graph (replayed or padded eager)
        self.memory_bytes = 0     # device memory the captures took (graph pool + buffers), measured
        self.pool: Any = None     # the captures' memory pool (the mixed-step graphs capture into it too)
        self.capture_s = 0.0

    def shapes(self) -> list[tuple[int, int]]:
        """(padded batch size, query slots per row) of every graph: the decode sizes, then the verification ones."""
        return [(s, 1) for s in self.sizes] + [(s, self.verify_len) for s in self.verify_sizes]

    # ---------------------------------------------------------------- selection
    def padded_size(self, num_seqs: int, q: int = 1) -> int | None:
        return next((s for s in (self.sizes if q == 1 else self.verify_sizes) if s >= num_seqs), None)

    def query_slots(self, host: HostBatch) -> int:
        """1 for a decode-only step, k+1 for a verification-shaped one (every row a decode or a row with drafts
        of at most k+1 tokens), 0 for any other step (prefill chunks)."""
        if host.decode_only:
            return 1
        q = self.verify_len
        if not q or int(host.num_new.max()) > q:
            return 0
        ok = all(n == 1 or r.num_spec_tokens for r, n in zip(host.requests, host.num_new.tolist()))
        return q if ok else 0

    def can_run(self, host: HostBatch, in_flight: bool = False) -> bool:
        """Called once per step: True when a graph of this runner serves it, else the step runs eagerly.
        `in_flight`: some input tokens are still on the device (async scheduling), patched by the caller into
        the decode graph's ids (a verification graph never takes them: speculation runs synchronous steps)."""
        n = len(host.requests)
        if host.decode_only:
            if n > self.max_batch_size:
                self.num_fallbacks += 1
                return False
            return True
        if not any(r.num_spec_tokens for r in host.requests):
            return False                                   # prefill chunks
        self.num_verify_steps += 1
        return (self.query_slots(host) > 1 and not in_flight
                and self.padded_size(n, self.verify_len) is not None)

    # ---------------------------------------------------------------- inputs
    def _meta(self, size: int, q: int) -> AttentionMetadata:
        t = self.max_tokens
        km = self.kernel_metas[(size, q)]
        return AttentionMetadata(
            slot_mapping=self.dev64[2 * t:2 * t + size * q], num_decode_tokens=size * q,
            decode_block_tables=km.block_tables, decode_context_lens=km.seq_lens, prefill_query_starts=[],
            prefill_query_lens=[], prefill_context_lens=[], prefill_block_tables=[], block_size=self.block_size,
            decode_groups=[(0, size, self.width)], kernel_meta=km)

    def _fill(self, host: HostBatch | None, size: int, q: int) -> None:
        """Writes a step's inputs (None: the padding of a capture) into the staging buffers; copies them."""
        b, w, t = self.max_batch_size, self.width, self.max_tokens
        h64, h32 = self.staging.next()
        n = 0 if host is None else len(host.requests)
        h64[:2 * t], h64[2 * t:3 * t], h64[3 * t:] = 0, -1, 0
        h32[:3 * b] = 1
        if n:
            ctx = host.context_lens
            if q == 1:
                h64[:n], h64[t:t + n], h64[2 * t:2 * t + n] = host.token_ids, host.positions, host.slot_mapping
            else:
                where = graph_token_index(host, q)                                # [T]
                h64[where], h64[t + where], h64[2 * t + where] = host.token_ids, host.positions, host.slot_mapping
                h64[3 * t:3 * t + len(where)] = where
                h32[2 * b:2 * b + n] = host.num_new
            h32[:n] = ctx
            h32[b:b + n] = self.backend.graph_decode_splits(
                ctx, decode_groups(ctx, self.block_size), size, self.num_kv_heads, self.caps[size], self.block_size,
                self.device)
            tables = h32[3 * b:3 * b + size * w].reshape(size, w)                # [B, W]
            cols = min(w, host.tables.shape[1])
            tables[:n, :cols] = host.tables[:, :cols]
        count = 3 * b + (max(n, 1) if host is not None else size) * w
        self.staging.copy_to([self.dev64, self.dev32], [4 * t, count])

    def _forward(self, size: int, q: int) -> torch.Tensor:
        t = self.max_tokens
        # fresh views every call: the rotary table lookup is memoized per positions tensor object
        return self.model(self.dev64[:size * q], self.dev64[t:t + size * q], self.kv_caches, self._meta(size, q))

    def _set_lora(self, token_slots: np.ndarray | None, size: int, q: int, host: HostBatch | None = None) -> bool:
        """Per token slot of the graph: the LoRA slot (-1: base, and every padding slot)."""
        if self.lora is None or token_slots is None or not (token_slots >= 0).any():
            self.lora_context is not None and self.lora_context.clear()
            return False
        if q > 1 and host is not None:
            slots = np.full(size * q, -1, dtype=np.int64)
            slots[graph_token_index(host, q)] = token_slots
            token_slots = slots
        self.lora.fill(token_slots, size * q)
        self.lora_context.set_meta(self.lora.meta(size * q))
        return True

    # ---------------------------------------------------------------- capture / run
    def _capture_shapes(self) -> list[tuple[int, int, bool]]:
        """(size, query slots, LoRA) of every graph, largest first."""
        loras = (False, True) if self.lora is not None else (False,)
        return [(s, q, lo) for s, q in sorted(self.shapes(), key=lambda e: e[0] * e[1], reverse=True)
                for lo in loras]

    def _prime(self, size: int, q: int, with_lora: bool) -> None:
        """The inputs of a capture: padding only; every token on slot 0 for the LoRA graphs."""
        self._fill(None, size, q)
        self._set_lora(np.zeros(size * q, np.int64) - 1 + (1 if with_lora else 0), size, q)

    def capture(self) -> int:
        """Captures every shape (largest first, one shared memory pool), with and without LoRA; returns the
        number of graphs. Without graphs (CPU tests) it runs each of those forwards once (the kernel warm-up)."""
        if not self.use_graphs:
            return self._warm_forwards()
        start = time.monotonic()
        torch.cuda.synchronize(self.device)
        reserved_before = torch.cuda.memory_reserved(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = self.pool = torch.cuda.graph_pool_handle()
        for size, q, with_lora in self._capture_shapes():
            self._prime(size, q, with_lora)
            self._forward(size, q)                                    # warm-up: compiles the Triton kernels
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size, q)
            self.graphs[(size, q, with_lora)] = (graph, out)
            if self.lora_context is not None:
                self.lora_context.clear()
        torch.cuda.synchronize(self.device)
        # the graphs' private pool is part of the caching allocator's reserved memory; device-wide free memory
        # also sees cuBLAS workspaces and the like (and can grow when the allocator releases cached blocks)
        self.memory_bytes = max(torch.cuda.memory_reserved(self.device) - reserved_before,
                                free_before - torch.cuda.mem_get_info(self.device)[0], 0)
        self.capture_s = time.monotonic() - start
        log.info("captured %d decode graphs (sizes %s; verification, %d query slots: %s) in %.1f s, %.0f MiB",
                 len(self.graphs), list(self.sizes), self.verify_len, list(self.verify_sizes), self.capture_s,
                 self.memory_bytes / 2 ** 20)
        if self.memory_bytes > CUDA_GRAPH_RESERVE_BYTES:
            log.warning("decode graphs took %.0f MiB, more than the %.0f MiB kept out of the KV pool for them; "
                        "lower --gpu-memory-utilization if the device runs out of memory",
                        self.memory_bytes / 2 ** 20, CUDA_GRAPH_RESERVE_BYTES / 2 ** 20)
        return len(self.graphs)

    def _warm_forwards(self) -> int:
        num = 0
        for size, q, with_lora in self._capture_shapes():
            self._prime(size, q, with_lora)
            self._forward(size, q)
            num += 1
            if self.lora_context is not None:
                self.lora_context.clear()
        return num

    def run(self, host: HostBatch, token_slots: np.ndarray | None,
            on_inputs: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Hidden states of a step `can_run` accepted (`token_slots`: per-token LoRA slot, -1 = base): [n, hidden]
        in batch row order for a decode step, [T, hidden] in flat token order for a verification step.
        `on_inputs(input_ids)` may rewrite the device input ids of a decode step (tokens still in flight)."""
        n = len(host.requests)
        # the driver's `can_run` accepted the step (a tensor-parallel worker's batch carries no requests)
        q = 1 if host.decode_only else self.verify_len
        size = self.padded_size(n, q)
        assert size is not None and q >= 1 and int(host.num_new.max()) <= q and (q == 1 or on_inputs is None)
        self._fill(host, size, q)
        if on_inputs is not None:
            on_inputs(self.dev64[:n])
        with_lora = self._set_lora(token_slots, size, q, host)
        self.num_runs += 1
        self.num_verify_runs += q > 1
        try:
            if not self.use_graphs:
                out = self._forward(size, q)
            else:
                graph, out = self.graphs[(size, q, with_lora)]
                graph.replay()
                self.num_replays += 1
            if q == 1:
                return out[:n]
            t = self.max_tokens
            return out.index_select(0, self.dev64[3 * t:3 * t + host.num_tokens])              # [T, hidden]
        finally:
            if self.lora_context is not None:
                self.lora_context.clear()


def build_decode_graphs(config: Any, parts: Any) -> DecodeGraphRunner | None:
    """The decode graph runner on CUDA with the Triton attention backend (None: eager steps only), with the
    verification graphs of a speculative config; its `capture()` runs in the start-up warm-up."""
    if parts.device.type != "cuda" or config.enforce_eager:
        return None
    if getattr(parts.model.config, "num_experts", 0):
        log.warning("decode CUDA graphs are not captured for a mixture-of-experts model (the experts' grouping reads "
                    "the per-expert row counts on the host); running eagerly")
        return None
    from core.attention.triton_backend import TritonAttentionBackend  # optional: triton

    backend = parts.model.model.layers[0].self_attn.backend
    if not isinstance(backend, TritonAttentionBackend):
        log.warning("decode CUDA graphs need the Triton attention backend; running eagerly")
        return None
    sizes = default_capture_sizes(config.scheduler.max_num_seqs)
    spec = config.speculative
    verify_len = spec.num_speculative_tokens + 1 if spec is not None else 0
    verify_sizes = verify_capture_sizes(sizes, spec.disable_by_batch_size) if spec is not None else ()
    lora = None
    if parts.lora_pool is not None:
        lora = GraphLoRABuffers(graph_num_tokens(sizes, verify_len, verify_sizes), parts.lora_pool.num_slots,
                                parts.device)
    return DecodeGraphRunner(parts.model, parts.kv_caches, backend, config.cache.block_size, parts.max_model_len,
                             sizes, lora=lora, lora_context=parts.lora_pool.context if lora else None,
                             verify_len=verify_len, verify_sizes=verify_sizes)
