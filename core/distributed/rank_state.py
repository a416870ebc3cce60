"""What every rank builds for itself: its model shard, its LoRA slot pool and the KV pool of its KV heads.

`build_rank_model` is the one model loader: the driver and the workers of a tensor-parallel engine, a single-rank
engine (a shard of world size 1: the whole model) and the speculative draft model all load through it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adapters.lora_ops import LoRABackends
from core.attention.selection import get_attention_backend
from core.config import EngineConfig
from core.distributed.layers import parallelize_model
from core.distributed.lora import ShardedSlotPool, apply_tp_lora_wrappers
from core.distributed.parallel_state import TPGroup
from core.distributed.shard import TPShard
from core.distributed.weights import load_weights
from core.environment import variables as env
from core.environment.backends import lora_backends
from core.models.llama import LlamaForCausalLM
from core.models.cpu_linear import pack_cpu_linears
from core.models.loader import init_dummy_weights
from core.models.meta_init import materialize, skip_param_init
from core.models.moe import Experts
from core.models.registry import model_class
from core.models.rope import layer_rotaries
from core.quant.config import QuantScheme, UnsupportedQuantization, detect_quantization
from core.quant.loader import finish_quantized, prepare_quantized, quantize_dummy

log = logging.getLogger(__name__)


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


def _check_quantized_moe(scheme: QuantScheme | None, quantization: str | None) -> None:
    """Quantized MoE models are served as compressed-tensors pack-quantized checkpoints (W4A16 / W8A16 experts,
    core/quant/experts.py) of Mixtral / Qwen2-MoE / Qwen3-MoE, on one rank or several; anything else is refused at
    start-up by name (`scheme`: the checkpoint's, None for random weights)."""
    why = None
    if scheme is None or scheme.fmt == "fp8-online":
        why = f"--quantization {quantization} (online quantization)" if quantization else "random weights"
    elif scheme.fmt != "pack-quantized":
        why = f"{scheme.method} ({scheme.fmt}) checkpoints"
    if why is not None:
        raise UnsupportedQuantization(f"quantized mixture-of-experts models with {why} are not supported; quantized "
                                      "experts are served from compressed-tensors pack-quantized (W4A16 / W8A16) "
                                      "checkpoints")


def build_rank_model(model_dir: Path, shard: TPShard, tp: TPGroup, device: torch.device, dtype: torch.dtype,
                     max_model_len: int, load_format: str = "auto", quantization: str | None = None) -> LlamaForCausalLM:
    """The model built from the rank's local config on the meta device (no random init), parallelized (at
    N > 1), then filled with its slices only: checkpoint weights, quantized ones included, or random weights
    (`load_format="dummy"`, online FP8 included)."""
    local = shard.local_config()
    quant = None if load_format == "dummy" else detect_quantization(model_dir, quantization)
    if local.num_experts and (quantization or quant):
        _check_quantized_moe(quant, quantization)
    with torch.device("meta"), skip_param_init():
        model = model_class(local)(local, get_attention_backend(device), max_model_len)
        parallelize_model(model, shard, tp)
    # a quantized checkpoint's float experts are never allocated: prepare_quantized puts packed ones in their place
    model = materialize(model, device, dtype, keep_meta=(Experts,) if quant is not None and local.num_experts else ())
    for layer, rotary in zip(model.model.layers, layer_rotaries(local, max_model_len)):
        layer.self_attn.rotary = rotary.to(device)
    if local.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if load_format == "dummy":
        init_dummy_weights(model, seed=shard.rank)
        quantize_dummy(model, model_dir, quantization)
    else:
        skip = prepare_quantized(model, model_dir, quant, dtype, device, shard) if quant else frozenset()
        load_weights(model, model_dir, shard, skip)
        if quant:
            finish_quantized(model, quant)
    if device.type == "cpu":
        pack_cpu_linears(model)
    return model.eval()


def build_rank_state(config: EngineConfig, model_dir: Path, shard: TPShard, tp: TPGroup, device: torch.device,
                     dtype: torch.dtype, max_model_len: int) -> RankState:
    """The rank's model with LoRA wrappers over its slot pool (the driver of several ranks journals the pool's
    writes for the workers). The KV pool comes later (`allocate_kv`), once every rank knows its size."""
    model = build_rank_model(model_dir, shard, tp, device, dtype, max_model_len, config.load_format,
                             config.quantization.method)
    if env.LORA_OVERLAP.is_set() and env.LORA_OVERLAP.get() and tp.world_size > 1 and tp.rank == 0:
        log.warning("LORAPLEX_LORA_OVERLAP=1 is ignored with tensor parallelism (%d ranks): the LoRA deltas run "
                    "beside the base GEMMs on one GPU only", tp.world_size)
    pool = ShardedSlotPool(config.lora.max_loras, config.lora.max_lora_rank, shard, device, dtype,
                           journal=tp.rank == 0 and tp.world_size > 1,
                           backends=LoRABackends(*lora_backends(device.type),
                                                 overlap=env.LORA_OVERLAP.get() and tp.world_size == 1),
                           tp=tp)
    apply_tp_lora_wrappers(model, pool, tp)
    return RankState(shard=shard, model=model, lora_pool=pool, device=device, dtype=dtype, kv_caches=[])


def allocate_kv(state: RankState, num_blocks: int, block_size: int) -> None:
    local = state.shard.local_config()
    shape = (num_blocks, block_size, local.num_kv_heads, local.head_dim)   # this rank's KV heads only
    state.kv_caches = [(torch.zeros(shape, dtype=state.dtype, device=state.device),
                        torch.zeros(shape, dtype=state.dtype, device=state.device))
                       for _ in range(local.num_layers)]
