"""CUDA graphs for decode steps: one graph per (padded batch size, LoRA on/off), replayed over persistent buffers.

A decode-only step of n requests runs the graph of the smallest captured size B >= n. Its inputs (ids,
positions, slot mapping, context lengths, split counts, block tables; LoRA tiles when adapters are in the
batch) are written on the host into pinned staging buffers and reach the device with one non-blocking copy
per buffer, then the graph replays every kernel of the forward with no Python in between. Padded rows have
slot -1 (the KV store skips them), context length 1 and block table row 0; their outputs are dropped.
Steps with prefill chunks, with speculative drafts (verification: k+1 query tokens per row, on the mixed
path), or with more decodes than the largest size, run eagerly.

`use_graphs=False` runs the same padded path without capturing (tests on the CPU, under TRITON_INTERPRET).
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
from adapters.lora_ops.graph_meta import GraphLoRABuffers

log = logging.getLogger("loraplex.cuda_graphs")


def default_capture_sizes(max_num_seqs: int, limit: int = 256) -> tuple[int, ...]:
    ladder = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    top = min(max_num_seqs, limit)
    sizes = [b for b in ladder if b < top] + [top]
    return tuple(sorted(set(sizes)))


class DecodeGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: Any,
                 block_size: int, max_model_len: int, capture_sizes: tuple[int, ...], lora: Any = None,
                 lora_context: Any = None, use_graphs: bool = True) -> None:
        """`backend`: the model's TritonAttentionBackend; `lora`: GraphLoRABuffers (None: no adapters)."""
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.block_size = block_size
        self.sizes = tuple(sorted(capture_sizes))
        self.max_batch_size = self.sizes[-1]
        self.lora, self.lora_context = lora, lora_context
        self.use_graphs = use_graphs
        k_cache = kv_caches[0][0]
        self.device = k_cache.device
        self.num_kv_heads = k_cache.shape[2]
        self.width = -(-max_model_len // block_size)                    # block table columns
        b, w = self.max_batch_size, self.width
        pin = self.device.type == "cuda"
        # int64: ids | positions | slots;  int32: seq lens | split counts | block tables [B, W].
        # Two staging sets, used in turn: with async scheduling step t+1 is filled while step t's copy may
        # still be queued; the copy of step t-1 (same set) is done, since its tokens were read.
        self.staging = [(torch.zeros(3 * b, dtype=torch.int64, pin_memory=pin),
                         torch.zeros(2 * b + b * w, dtype=torch.int32, pin_memory=pin)) for _ in range(2)]
        self.num_fills = 0
        self.copied: list[torch.cuda.Event | None] = [None, None]   # last copy out of each staging set
        self.dev64 = torch.zeros(3 * b, dtype=torch.int64, device=self.device)
        self.dev32 = torch.zeros(2 * b + b * w, dtype=torch.int32, device=self.device)
        self.caps = {s: backend.graph_max_splits(s, self.num_kv_heads, self.device) for s in self.sizes}
        self.kernel_metas = {s: backend.graph_kernel_meta(
            s, self.caps[s], self.dev32[:s], self.dev32[2 * b:2 * b + s * w].view(s, w), self.dev32[b:b + s])
            for s in self.sizes}
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0      # graph replays
        self.num_runs = 0         # steps through this runner (replayed or, without graphs, eager)
        self.num_fallbacks = 0    # decode-only steps with more rows than the largest graph (run eagerly)
        self.num_verify_steps = 0  # steps with speculative drafts (k+1 query tokens per row: run eagerly)
        self.memory_bytes = 0     # device memory the captures took (graph pool + buffers), measured
        self.capture_s = 0.0

    # ---------------------------------------------------------------- selection
    def padded_size(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def can_run(self, host: HostBatch) -> bool:
        """Called once per step: True when a graph of this runner serves it, else the step runs eagerly."""
        if not host.decode_only:
            # a row with drafts (speculative verification) has k+1 query tokens: never a decode graph
            self.num_verify_steps += any(r.num_spec_tokens for r in host.requests)
            return False
        if len(host.requests) > self.max_batch_size:
            self.num_fallbacks += 1
            return False
        return True

    # ---------------------------------------------------------------- inputs
    def _meta(self, size: int) -> AttentionMetadata:
        b = self.max_batch_size
        km = self.kernel_metas[size]
        return AttentionMetadata(
            slot_mapping=self.dev64[2 * b:2 * b + size], num_decode_tokens=size,
            decode_block_tables=km.block_tables, decode_context_lens=km.seq_lens, prefill_query_starts=[],
            prefill_query_lens=[], prefill_context_lens=[], prefill_block_tables=[], block_size=self.block_size,
            decode_groups=[(0, size, self.width)], kernel_meta=km)

    def _fill(self, host: HostBatch | None, size: int) -> None:
        """Writes a step's inputs (None: the padding of a capture) into the staging buffers; copies them."""
        b, w = self.max_batch_size, self.width
        turn = self.num_fills % 2
        host64, host32 = self.staging[turn]
        self.num_fills += 1
        if self.copied[turn] is not None:
            self.copied[turn].synchronize()   # its last copy is done (already, when tokens are read each step)
        h64, h32 = host64.numpy(), host32.numpy()
        n = 0 if host is None else len(host.requests)
        h64[:b], h64[b:2 * b], h64[2 * b:] = 0, 0, -1
        h32[:b], h32[b:2 * b] = 1, 1
        if n:
            ctx = host.context_lens
            h64[:n], h64[b:b + n], h64[2 * b:2 * b + n] = host.token_ids, host.positions, host.slot_mapping
            h32[:n] = ctx
            h32[b:b + n] = self.backend.graph_decode_splits(
                ctx, decode_groups(ctx, self.block_size), size, self.num_kv_heads, self.caps[size], self.block_size,
                self.device)
            tables = h32[2 * b:2 * b + size * w].reshape(size, w)                # [B, W]
            cols = min(w, host.tables.shape[1])
            tables[:n, :cols] = host.tables[:, :cols]
        non_blocking = self.device.type == "cuda"
        self.dev64.copy_(host64, non_blocking=non_blocking)
        count = 2 * b + (max(n, 1) if host is not None else size) * w
        self.dev32[:count].copy_(host32[:count], non_blocking=non_blocking)
        if non_blocking:
            self.copied[turn] = torch.cuda.Event()
            self.copied[turn].record(torch.cuda.current_stream(self.device))

    def _forward(self, size: int) -> torch.Tensor:
        b = self.max_batch_size
        # fresh views every call: the rotary table lookup is memoized per positions tensor object
        return self.model(self.dev64[:size], self.dev64[b:b + size], self.kv_caches, self._meta(size))

    def _set_lora(self, token_slots: np.ndarray | None, size: int) -> bool:
        if self.lora is None or token_slots is None or not (token_slots >= 0).any():
            self.lora_context is not None and self.lora_context.clear()
            return False
        self.lora.fill(token_slots, size)
        self.lora_context.set_meta(self.lora.meta(size))
        return True

    # ---------------------------------------------------------------- capture / run
    def capture(self) -> int:
        """Captures every size (largest first, one shared memory pool), with and without LoRA; returns the
        number of graphs. Without graphs (CPU tests) it runs each of those forwards once (the kernel warm-up)."""
        if not self.use_graphs:
            return self._warm_forwards()
        start = time.monotonic()
        torch.cuda.synchronize(self.device)
        reserved_before = torch.cuda.memory_reserved(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            for with_lora in (False, True) if self.lora is not None else (False,):
                self._fill(None, size)
                self._set_lora(np.zeros(size, np.int64) - 1 + (1 if with_lora else 0), size)
                self._forward(size)                                   # warm-up: compiles the Triton kernels
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(size)
                self.graphs[(size, with_lora)] = (graph, out)
                if self.lora_context is not None:
                    self.lora_context.clear()
        torch.cuda.synchronize(self.device)
        # the graphs' private pool is part of the caching allocator's reserved memory; device-wide free memory
        # also sees cuBLAS workspaces and the like (and can grow when the allocator releases cached blocks)
        self.memory_bytes = max(torch.cuda.memory_reserved(self.device) - reserved_before,
                                free_before - torch.cuda.mem_get_info(self.device)[0], 0)
        self.capture_s = time.monotonic() - start
        log.info("captured %d decode graphs (sizes %s) in %.1f s, %.0f MiB", len(self.graphs), list(self.sizes),
                 self.capture_s, self.memory_bytes / 2 ** 20)
        if self.memory_bytes > CUDA_GRAPH_RESERVE_BYTES:
            log.warning("decode graphs took %.0f MiB, more than the %.0f MiB kept out of the KV pool for them; "
                        "lower --gpu-memory-utilization if the device runs out of memory",
                        self.memory_bytes / 2 ** 20, CUDA_GRAPH_RESERVE_BYTES / 2 ** 20)
        return len(self.graphs)

    def _warm_forwards(self) -> int:
        num = 0
        for size in reversed(self.sizes):
            for with_lora in (False, True) if self.lora is not None else (False,):
                self._fill(None, size)
                self._set_lora(np.zeros(size, np.int64) - 1 + (1 if with_lora else 0), size)
                self._forward(size)
                num += 1
                if self.lora_context is not None:
                    self.lora_context.clear()
        return num

    def run(self, host: HostBatch, token_slots: np.ndarray | None,
            on_inputs: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step (`token_slots`: per-request LoRA slot, -1 = base).
        `on_inputs(input_ids)` may rewrite the device input ids (tokens still in flight) before the replay."""
        n = len(host.requests)
        size = self.padded_size(n)
        assert size is not None and host.decode_only
        self._fill(host, size)
        if on_inputs is not None:
            on_inputs(self.dev64[:n])
        with_lora = self._set_lora(token_slots, size)
        self.num_runs += 1
        try:
            if not self.use_graphs:
                return self._forward(size)[:n]
            graph, out = self.graphs[(size, with_lora)]
            graph.replay()
            self.num_replays += 1
            return out[:n]
        finally:
            if self.lora_context is not None:
                self.lora_context.clear()


def build_decode_graphs(config: Any, parts: Any) -> DecodeGraphRunner | None:
    """The decode graph runner on CUDA with the Triton attention backend (None: eager steps only); its
    `capture()` runs in the start-up warm-up."""
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
    lora = None
    if parts.lora_pool is not None:
        lora = GraphLoRABuffers(sizes[-1], parts.lora_pool.num_slots, parts.device)
    return DecodeGraphRunner(parts.model, parts.kv_caches, backend, config.cache.block_size, parts.max_model_len,
                             sizes, lora=lora, lora_context=parts.lora_pool.context if lora else None)
