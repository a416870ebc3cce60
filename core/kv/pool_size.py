"""How many KV blocks a rank's pool holds: `--num-kv-blocks`, `--kv-cache-memory`, or what the device has left."""
from __future__ import annotations

import torch

from core.config import EngineConfig, ModelConfig

CPU_DEFAULT_KV_BYTES = 2 << 30
# CUDA: memory kept out of the KV pool for the decode graphs' shared pool (activations of the largest
# captured batch and split-KV partials; measured ~100 MiB for the 8B shape at batch 256) and the eager
# prefill activations
CUDA_GRAPH_RESERVE_BYTES = 512 << 20


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


def num_kv_blocks(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                  max_model_len: int) -> int:
    """`cfg`: the model config of this rank's shard (its KV heads)."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = kv_bytes_per_block(cfg, cache.block_size, dtype)
    if cache.kv_cache_memory is not None:
        return max(1, cache.kv_cache_memory // per_block)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * cache.gpu_memory_utilization) - (total - free)
        if not config.enforce_eager:
            budget -= CUDA_GRAPH_RESERVE_BYTES
        return max(1, budget // per_block)
    needed = -(-max_model_len // cache.block_size) * config.scheduler.max_num_seqs
    return max(1, min(CPU_DEFAULT_KV_BYTES // per_block, needed))
