"""What every rank builds for itself: its model shard, its LoRA slot pool and the KV pool of its KV heads."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adapters.lora_ops import LoRABackends
from core.attention.backend import get_attention_backend
from core.config import EngineConfig
from core.distributed.layers import parallelize_model
from core.distributed.lora import ShardedSlotPool, apply_tp_lora_wrappers
from core.distributed.parallel_state import TPGroup
from core.distributed.shard import TPShard, load_sharded_weights
from core.environment.backends import lora_backends
from core.models.llama import LlamaForCausalLM
from core.models.registry import model_class
from core.models.loader import init_dummy_weights
from core.models.meta_init import materialize, skip_param_init
from core.models.rope import layer_rotaries
from core.quant.config import detect_quantization
from core.quant.loader import finish_quantized, prepare_quantized, quantize_dummy


@dataclass
class RankState:
    shard: TPShard
    model: LlamaForCausalLM
    lora_pool: ShardedSlotPool
    device: torch.device
    dtype: torch.dtype
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    graphs: Any = None                       # DecodeGraphRunner (workers), built by the capture command
    last_tokens: torch.Tensor | None = None  # the last step's sampled tokens [N] (async scheduling)


def build_rank_model(config: EngineConfig, model_dir: Path, shard: TPShard, tp: TPGroup, device: torch.device,
                     dtype: torch.dtype, max_model_len: int) -> RankState:
    """The model built from the rank's local config on the meta device, parallelized, then loaded
    with its slices only; LoRA wrappers over a sharded slot pool. The KV pool comes later (`allocate_kv`)."""
    local = shard.local_config()
    with torch.device("meta"), skip_param_init():
        model = model_class(local)(local, get_attention_backend(device), max_model_len)
        parallelize_model(model, shard, tp)
    model = materialize(model, device, dtype)
    for layer, rotary in zip(model.model.layers, layer_rotaries(local, max_model_len)):
        layer.self_attn.rotary = rotary.to(device)
    if local.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if config.load_format == "dummy":
        init_dummy_weights(model, seed=shard.rank)
        quantize_dummy(model, model_dir, config.quantization.method)
    else:
        quant = detect_quantization(model_dir, config.quantization.method)
        skip = prepare_quantized(model, model_dir, quant, dtype, device, shard) if quant else frozenset()
        load_sharded_weights(model, model_dir, shard, skip)
        if quant:
            finish_quantized(model, quant)
    model.eval()
    pool = ShardedSlotPool(config.lora.max_loras, config.lora.max_lora_rank, shard, device, dtype, journal=tp.is_driver,
                           backends=LoRABackends(*lora_backends(device.type)))
    apply_tp_lora_wrappers(model, pool, tp)
    return RankState(shard=shard, model=model, lora_pool=pool, device=device, dtype=dtype, kv_caches=[])


def allocate_kv(state: RankState, num_blocks: int, block_size: int) -> None:
    local = state.shard.local_config()
    shape = (num_blocks, block_size, local.num_kv_heads, local.head_dim)   # this rank's KV heads only
    state.kv_caches = [(torch.zeros(shape, dtype=state.dtype, device=state.device),
                        torch.zeros(shape, dtype=state.dtype, device=state.device))
                       for _ in range(local.num_layers)]


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device
