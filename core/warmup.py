"""Start-up kernel warm-up: launch every Triton kernel variant the engine can use, before it serves.

Triton compiles a kernel again for every new constexpr value, every change of an integer argument's
specialization (== 1, divisible by 16) and every change of a pointer's 16-byte alignment, and a compile
stalls the step that meets it (seconds, on the serving path). Each kernel family therefore draws its
variants from a small closed set, and this module launches each member once, on dummy data shaped like
real steps (same dtypes, strides and alignments), so serving meets no new variant:

- attention + fused RMSNorm/rope/SiLU + grammar bitmask: dummy forwards (reading and writing only block 0,
  before any request holds it) of a decode-only and a mixed batch, each with and without split-KV where the split
  policy can split, then the logits and one masked row;
- LoRA: every entry of the segmented table (`adapters/lora_ops/triton_ops.SEGMENT_CONFIGS`) and the BGMV
  decode kernels, for each fused linear, on scratch stacks shaped like the pool's;
- decode CUDA graphs: capturing them runs every captured size, with and without LoRA.

`tests/test_kernel_warmup.py` records the specialization key of every launch in the CPU interpreter and
proves that a randomized mixed workload launches nothing outside the warm-up set.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from core.runner import HostBatch, to_device
from core.structured import apply_token_masks

ProgressFn = Callable[[int, int, float], None]     # (variants done, total, seconds since the start)


@dataclass(frozen=True)
class KernelVariant:
    family: str
    label: str
    run: Callable[[], None] = field(compare=False, repr=False)


@dataclass(frozen=True)
class WarmupReport:
    num_variants: int
    num_graphs: int
    seconds: float
    num_jit_compiles: int          # Triton JIT cache misses during the warm-up (0 without a GPU)


def synthetic_batch(decode_lens: list[int], prefill_chunks: list[tuple[int, int]], block_size: int) -> HostBatch:
    """A flat batch of decodes (context lengths) then prefill chunks (cached tokens, new tokens) whose block
    tables point at block 0 and whose new K/V go to block 0: the warm-up runs before any request holds a block,
    and a block's positions are always written by its owner before they are read."""
    num_new = np.asarray([1] * len(decode_lens) + [n for _, n in prefill_chunks], dtype=np.int64)
    ctx = np.asarray(list(decode_lens) + [c + n for c, n in prefill_chunks], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int64)
    seq_of_token = np.repeat(np.arange(len(num_new)), num_new)                       # [T]
    positions = (ctx - num_new)[seq_of_token] + np.arange(int(cu[-1])) - cu[:-1][seq_of_token]
    max_blocks = int(-(-ctx.max() // block_size))
    return HostBatch(requests=[None] * len(num_new), num_new=num_new, cu=cu,  # type: ignore[list-item]
                     token_ids=np.zeros(int(cu[-1]), np.int64), positions=positions.astype(np.int64),
                     slot_mapping=np.arange(int(cu[-1]), dtype=np.int64) % block_size,
                     tables=np.zeros((len(num_new), max_blocks), np.int64), context_lens=ctx,
                     num_decode=len(decode_lens), samples=list(range(len(num_new))))


Shape = tuple[str, list[int], list[tuple[int, int]]]     # (label, decode context lengths, prefill chunks)


def forward_shapes(engine: Any) -> list[Shape]:
    """The dummy steps whose forwards launch every attention / fused-op variant (none without Triton)."""
    from core.attention.triton_backend import TritonAttentionBackend
    from core.models.fused_ops import use_triton

    backend = engine.model.model.layers[0].self_attn.backend
    triton_attention = isinstance(backend, TritonAttentionBackend)
    probe = torch.empty(1, device=engine.device)
    if not (triton_attention or use_triton(probe)):
        return []
    bs = engine.block_size
    short = min(bs, engine.max_model_len - 1)
    # long enough to split when the split policy splits at all (a batch of one on a GPU)
    long = min(engine.max_model_len - 4, 4 * getattr(backend, "min_partition", 256))
    can_split = triton_attention and long > 2 * backend.min_partition and \
        backend.graph_max_splits(1, engine.model_config.num_kv_heads, engine.device) > 1
    shapes: list[Shape] = [("decode", [short], []), ("mixed", [short], [(0, 3)])]
    if can_split:
        shapes += [("decode+split", [long], []), ("mixed+split", [long], [(0, 3)])]
    return shapes


def dummy_forward(model: Any, kv_caches: Any, lora_pool: Any, block_size: int, device: torch.device,
                  decode_lens: list[int], prefill_chunks: list[tuple[int, int]]) -> torch.Tensor:
    """One synthetic step through `model` (any rank's shard) and its LM head; returns the logits (rank 0)."""
    host = synthetic_batch(decode_lens, prefill_chunks, block_size)
    batch = to_device(host, block_size, device)
    if lora_pool is not None:
        lora_pool.context.clear()
    hidden = model(batch.input_ids, batch.positions, kv_caches, batch.meta)                  # [T, hidden]
    return model.compute_logits(hidden[batch.logits_indices])                                # [N, vocab]


def _dummy_step(engine: Any, decode_lens: list[int], prefill_chunks: list[tuple[int, int]]) -> None:
    logits = dummy_forward(engine.model, engine.kv_caches, engine.lora_pool, engine.block_size, engine.device,
                           decode_lens, prefill_chunks)
    from grammar.bitmask import allocate_token_bitmask

    masks = (allocate_token_bitmask(logits.shape[0], engine.model_config.vocab_size), torch.zeros(1, dtype=torch.int64))
    apply_token_masks(logits, masks)


def lora_variants(model: Any, pool: Any, device: torch.device) -> list[KernelVariant]:
    """The LoRA kernel variants of one rank's fused linears, on scratch stacks (no collective)."""
    if pool is None:
        return []
    from adapters.layers import LoRALinear
    from adapters.lora_ops import select_backend

    probe = torch.empty(1, device=device)
    if select_backend(probe, pool.context.backend) != "triton":
        return []
    from adapters.lora_ops.triton_ops import SEGMENT_CONFIGS

    layer0 = model.model.layers[0]
    variants: list[KernelVariant] = []
    for module in layer0.modules():
        if not isinstance(module, LoRALinear):
            continue
        for cfg in SEGMENT_CONFIGS:
            variants.append(KernelVariant("lora", f"{module.group} {cfg}", lambda m=module, c=cfg: _segment(m, c)))
        variants.append(KernelVariant("lora", f"{module.group} bgmv", lambda m=module: _bgmv(m)))
    return variants


def _scratch(module: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A stack shaped like the module's (slot 0 at the pool's max rank), an input row and an output row."""
    from adapters.lora_ops import LoRAStack

    st = module.stack
    ranks = torch.zeros_like(st.ranks_host)
    ranks[:, 0] = st.max_rank
    stack = LoRAStack(torch.zeros_like(st.lora_a), torch.zeros_like(st.lora_b), ranks.to(st.ranks.device),
                      torch.ones_like(st.scalings), st.slice_offsets, st.slice_sizes, ranks_host=ranks,
                      scalings_host=torch.ones_like(st.scalings_host))
    dev, dtype = st.lora_a.device, st.lora_a.dtype
    x = torch.zeros(1, module.in_features, device=dev, dtype=dtype)
    y = torch.zeros(1, module.out_features, device=dev, dtype=dtype)
    return stack, x, y


def _segment(module: Any, cfg: Any) -> None:
    from adapters.lora_ops import LoRABatchMeta
    from adapters.lora_ops.triton_ops import triton_add_lora

    stack, x, y = _scratch(module)
    triton_add_lora(y, x, stack, LoRABatchMeta.build([0], x.device), module.y_offset, config=cfg)


def _bgmv(module: Any) -> None:
    from adapters.lora_ops.bgmv import DecodeLoRAMeta, triton_bgmv_add_lora

    stack, x, y = _scratch(module)
    zero = torch.zeros(1, dtype=torch.int32, device=x.device)
    triton_bgmv_add_lora(y, x, stack, DecodeLoRAMeta(num_tokens=1, row_slots=zero, row_order=zero.clone()),
                         module.y_offset)


def kernel_variants(engine: Any) -> list[KernelVariant]:
    """Every Triton kernel variant this engine can launch outside the decode graphs (empty on a plain CPU)."""
    from core.quant.warmup import quant_gemm_warmups

    forwards = [KernelVariant("forward", name, lambda d=d, p=p: _dummy_step(engine, d, p))
                for name, d, p in forward_shapes(engine)]
    quant = [KernelVariant("quant_gemm", label, run)
             for label, run in quant_gemm_warmups(engine.model, engine.device)]
    return forwards + quant + lora_variants(engine.model, engine.lora_pool, engine.device)


def run_warmup(engine: Any, progress: ProgressFn | None = None) -> WarmupReport:
    """Launches every variant, then captures the decode graphs; reports counts and seconds."""
    from core.kernel_compiles import COMPILES

    start = time.monotonic()
    compiles_before = COMPILES.total
    variants = kernel_variants(engine)
    if getattr(engine, "tp", None) is not None:   # the workers run the same dummy forwards (collectives pair up), then their LoRA
        engine.tp.warmup_forwards([(d, p) for _, d, p in forward_shapes(engine)])
    with torch.inference_mode():
        for i, variant in enumerate(variants):
            variant.run()
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
            if progress is not None:
                progress(i + 1, len(variants), time.monotonic() - start)
        num_graphs = engine.capture_decode_graphs()
    return WarmupReport(num_variants=len(variants), num_graphs=num_graphs, seconds=time.monotonic() - start,
                        num_jit_compiles=COMPILES.total - compiles_before)
