"""A tensor-parallel worker process (ranks 1..N-1): builds its shard, then runs the driver's steps.

Start-up: join the process groups, load the shard, report ("ready" | "error", rank, detail) on the
start-up queue, agree on the KV pool size (the minimum over ranks), then loop: receive a `StepInputs`
(None = shut down), replay the LoRA slot ops, run the forward, and join the logits gather when the
step samples. Any error ends the process with a non-zero code (the driver's monitor reports it); a
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
from core.distributed.rank_state import RankState, allocate_kv, build_rank_model, rank_device
from core.distributed.shard import TPShard
from core.distributed.step_inputs import StepInputs
from core.engine_setup import num_kv_blocks, resolve_device, resolve_dtype
from core.runner import to_device


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
        device = rank_device(resolve_device(config.device), rank)
        dtype = resolve_dtype(config.dtype, cfg, device)
        tp = init_tp_group(rank, world_size, init_method, device)
        shard = TPShard(cfg, rank, world_size)
        state = build_rank_model(config, Path(model_dir), shard, tp, device, dtype, max_model_len)
        local_blocks = num_kv_blocks(config, shard.local_config(), dtype, device, max_model_len)
    except BaseException:
        ready.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1)
    ready.put(("ready", rank, None))
    allocate_kv(state, tp.min_int(local_blocks), config.cache.block_size)
    run_steps(state, tp, config.cache.block_size)


@torch.inference_mode()
def run_steps(state: RankState, tp: TPGroup, block_size: int) -> None:
    while True:
        inputs: StepInputs | None = tp.broadcast_object()
        if inputs is None:
            return
        execute_step(state, inputs, block_size)


def execute_step(state: RankState, inputs: StepInputs, block_size: int) -> None:
    """The same forward as the driver's `LLMEngine._forward` + `compute_logits`, on this rank's shard."""
    pool = state.lora_pool
    pool.apply_ops(list(inputs.slot_ops))
    batch = to_device(inputs.to_host(), block_size, state.device)
    try:
        if inputs.token_slots is not None:
            pool.context.set_batch(inputs.token_slots)
        hidden = state.model(batch.input_ids, batch.positions, state.kv_caches, batch.meta)   # [T, hidden]
        if inputs.samples:
            state.model.compute_logits(hidden[batch.logits_indices])                        # joins the gather
    finally:
        pool.context.clear()
