"""A tensor-parallel worker process (ranks 1..N-1): builds its shard, then runs the driver's steps.

Start-up: join the process groups, load the shard, report ("ready" | "error", rank, detail) on the
start-up queue, agree on the KV pool size (the minimum over ranks), then loop on the driver's messages
(None = shut down): a `StepInputs` (replay the LoRA slot ops, run the forward eagerly or through the decode
graph, join the logits gathers, receive the sampled tokens under async scheduling), or the start-up
warm-up's `WarmupForwards` and `CaptureGraphs`. Any error ends the process with a non-zero code (the driver's monitor reports it); a
worker whose driver is gone exits too.
"""
from __future__ import annotations

import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from core.config import EngineConfig, ModelConfig
from core.distributed.parallel_state import TPGroup, init_tp_group
from core.distributed.rank_state import RankState, allocate_kv, build_rank_state
from core.distributed.shard import TPShard
from core.execution.cuda_graphs import DecodeGraphRunner, graph_num_tokens
from core.distributed.step_inputs import CaptureGraphs, StepInputs, WarmupForwards
from core.kv.pool_size import num_kv_blocks
from core.models.device import rank_device, resolve_device, resolve_dtype
from core.execution.pending import fixup_to_device, patch_inputs
from core.execution.runner import graph_sample_rows, host_to_device, to_device
from core.startup.warmup import dummy_forward, lora_variants
from adapters.lora_ops.graph_meta import GraphLoRABuffers


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(3)
    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def worker_main(rank: int, world_size: int, init_method: str, config: EngineConfig, model_dir: str,
                max_model_len: int, ready: Any, num_threads: int, parent_pid: int) -> None:
    _exit_with_parent(parent_pid)
    torch.set_num_threads(num_threads)
    try:
        cfg = ModelConfig.from_path(model_dir)
        device = rank_device(resolve_device(config.device), rank, world_size)
        dtype = resolve_dtype(config.dtype, cfg, device)
        tp = init_tp_group(rank, world_size, init_method, device)
        shard = TPShard(cfg, rank, world_size)
        state = build_rank_state(config, Path(model_dir), shard, tp, device, dtype, max_model_len)
        local_blocks = num_kv_blocks(config, shard.local_config(), dtype, device, max_model_len)
    except BaseException:
        ready.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1)
    ready.put(("ready", rank, None))
    allocate_kv(state, tp.min_int(local_blocks), config.cache.block_size)
    run_steps(state, tp, config.cache.block_size, max_model_len)


@torch.inference_mode()
def run_steps(state: RankState, tp: TPGroup, block_size: int, max_model_len: int) -> None:
    while True:
        message: StepInputs | WarmupForwards | CaptureGraphs | None = tp.broadcast_object()
        if message is None:
            return
        if isinstance(message, StepInputs):
            execute_step(state, tp, message, block_size)
        elif isinstance(message, WarmupForwards):
            warmup_rank(state, message, block_size)
        else:
            capture_rank_graphs(state, message, block_size, max_model_len)


def execute_step(state: RankState, tp: TPGroup, inputs: StepInputs, block_size: int) -> None:
    """The same forward as the driver's `LLMEngine._forward`, on this rank's shard, then the same collectives
    in the same order: the prompt log-prob rows' and the sampled rows' logits gathers, the sampled tokens."""
    pool = state.lora_pool
    pool.apply_ops(list(inputs.slot_ops))
    pool.finish_dora()                    # the driver's at the same point: after the slot writes, before the forward
    host = inputs.to_host()
    fixup = fixup_to_device(inputs.fixup, state.device)
    assert fixup is None or state.last_tokens is not None, "an input token in flight but none was shared"
    patch = (lambda ids: patch_inputs(ids, state.last_tokens, fixup)) if fixup is not None else None
    try:
        if inputs.use_graph:
            assert state.graphs is not None, "a decode graph step before the capture"
            hidden = state.graphs.run(host, inputs.token_slots, patch)                  # [B or T, hidden]
            rows = graph_sample_rows(host, state.device)
        else:
            batch = to_device(host, block_size, state.device)
            if patch is not None:
                patch(batch.input_ids)
            if inputs.token_slots is not None:
                pool.context.set_batch(inputs.token_slots)
            hidden = state.model(batch.input_ids, batch.positions, state.kv_caches, batch.meta)   # [T, hidden]
            rows = batch.logits_indices
        if inputs.prompt_rows is not None:
            state.model.compute_logits(hidden.index_select(0, torch.from_numpy(inputs.prompt_rows).to(state.device)))
        if inputs.logit_rows is not None:   # a step with drafts: every draft position joins the gather
            rows = host_to_device(inputs.logit_rows, state.device)
        if inputs.samples:
            state.model.compute_logits(hidden if rows is None else hidden[rows])
        if inputs.share_tokens:
            tokens = torch.empty(len(inputs.samples), dtype=torch.int64, device=state.device)   # [N]
            state.last_tokens = tp.broadcast_tensor(tokens)
    finally:
        pool.context.clear()


def warmup_rank(state: RankState, command: WarmupForwards, block_size: int) -> None:
    """The driver's warm-up forwards, in its order, then this rank's own LoRA kernel variants."""
    for decode_lens, chunks in command.shapes:
        dummy_forward(state.model, state.kv_caches, state.lora_pool, block_size, state.device, list(decode_lens),
                      list(chunks))
    for variant in lora_variants(state.model, state.lora_pool):
        variant.run()


def capture_rank_graphs(state: RankState, command: CaptureGraphs, block_size: int, max_model_len: int) -> None:
    backend = state.model.model.layers[0].self_attn.backend
    pool = state.lora_pool
    num_tokens = graph_num_tokens(command.sizes, command.verify_len, command.verify_sizes)
    lora = GraphLoRABuffers(num_tokens, pool.num_slots, state.device) if command.with_lora else None
    state.graphs = DecodeGraphRunner(state.model, state.kv_caches, backend, block_size, max_model_len,
                                     command.sizes, lora=lora, lora_context=pool.context if lora else None,
                                     use_graphs=command.use_graphs, verify_len=command.verify_len,
                                     verify_sizes=command.verify_sizes)
    state.graphs.capture()
