"""Start-up kernel warm-up: launch every Triton kernel variant the engine can use, before it serves.

Triton compiles a kernel again for every new constexpr value, every change of an integer argument's
specialization (== 1, divisible by 16) and every change of a pointer's 16-byte alignment, and a compile
stalls the step that meets it (seconds, on the serving path). Each kernel family therefore draws its
variants from a small closed set, and this module launches each member once, on dummy data shaped like
real steps (same dtypes, strides and alignments), so serving meets no new variant:

- attention + fused RMSNorm/rope/SiLU + grammar bitmask: dummy forwards (reading and writing only block 0,
  before any request holds it) of a decode-only and a mixed batch, each with and without split-KV where the split
  policy can split, then the logits and one masked row;
- speculative decoding: verification-shaped batches (rows of k+1 query tokens over a cached context, alone
  and beside decodes and a prefill chunk; steps with drafts never replay a decode graph, they run eagerly), and
  for `draft_model` the draft's own forwards (its head shapes are other kernel variants);
- LoRA: every entry of the segmented table (`adapters/lora_ops/triton_ops.SEGMENT_CONFIGS`) and the BGMV
  decode kernels, for each fused linear, on scratch stacks shaped like the pool's (fresh, so 16-byte aligned:
  the pool starts every layer's views on that boundary too, `adapters/slots/layer_buffers.py`, or the other
  layers would launch other pointer specializations);
- decode CUDA graphs: capturing them runs every captured size, with and without LoRA.

`tests/test_core/startup/test_kernel_warmup.py` records the specialization key of every launch in the CPU interpreter and
proves that a randomized mixed workload launches nothing outside the warm-up set.

On CUDA each variant is also compared with its torch path on the same inputs (`core/startup/kernel_selfcheck.py`,
LORAPLEX_KERNEL_SELFCHECK): a mismatch raises `KernelSelfCheckError` and the engine does not start.
"""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

log = logging.getLogger("loraplex.kernels")

from core.startup.kernel_compiles import COMPILES
from core.startup.kernel_selfcheck import KernelSelfCheck, selfcheck_enabled
from core.execution.runner import HostBatch, to_device
from core.sampling.grammar_masks import apply_token_masks, bitmask_backend
from core.quant.warmup import quant_gemm_warmups
from core.startup.kernel_checks import check_bgmv, check_bgmv_delta, check_bitmask, check_lora_segment, forward_hooks
from adapters.lora_ops.bgmv import DecodeLoRAMeta, triton_bgmv_add_lora
from adapters.lora_ops.bgmv_overlap import delta_buffer, triton_bgmv_add_delta, triton_bgmv_delta
from adapters.lora_ops import LoRABatchMeta, LoRAStack
from adapters.layers.lora_linear import LoRALinear
from adapters.layers.vocab_lora import LoRAEmbedding, LoRALMHead
from grammar.matching.bitmask import allocate_token_bitmask
from core.models.fused_ops import use_triton

ProgressFn = Callable[[int, int, float], None]     # (variants done, total, seconds since the start)


@dataclass(frozen=True)
class KernelVariant:
    family: str
    label: str
    run: Callable[[], None] = field(compare=False, repr=False)
    # the same launches, each also compared with its torch path (None: nothing to compare)
    check: Optional[Callable[[KernelSelfCheck], None]] = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class WarmupReport:
    num_variants: int
    num_graphs: int
    seconds: float
    num_jit_compiles: int          # Triton JIT cache misses during the warm-up (0 without a GPU)
    num_kernel_checks: int = 0     # kernel outputs compared with the torch path (0: self-check off)
    selfcheck_seconds: float = 0.0


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
    k = engine.spec.num_speculative_tokens
    return model_shapes(engine.model, engine.model_config.num_kv_heads, engine.block_size, engine.max_model_len,
                        engine.device, k)


def model_shapes(model: Any, num_kv_heads: int, block_size: int, max_model_len: int, device: torch.device,
                 num_speculative_tokens: int = 0) -> list[Shape]:
    """`forward_shapes` of one model; with speculation (k > 0) also verification-shaped steps: rows of k+1
    query tokens over a cached context, alone and beside decodes and a prefill chunk."""
    from core.attention.triton_backend import TritonAttentionBackend  # optional: triton

    backend = model.model.layers[0].self_attn.backend
    triton_attention = isinstance(backend, TritonAttentionBackend)
    probe = torch.empty(1, device=device)
    if not (triton_attention or use_triton(probe)):
        return []
    short = min(block_size, max_model_len - 1)
    # long enough to split when the split policy splits at all (a batch of one on a GPU)
    long = min(max_model_len - 4, 4 * getattr(backend, "min_partition", 256))
    can_split = triton_attention and long > 2 * backend.min_partition and \
        backend.graph_max_splits(1, num_kv_heads, device) > 1
    shapes: list[Shape] = [("decode", [short], []), ("mixed", [short], [(0, 3)])]
    if can_split:
        shapes += [("decode+split", [long], []), ("mixed+split", [long], [(0, 3)])]
    q = num_speculative_tokens + 1
    if num_speculative_tokens and max_model_len > q + 1:
        cached = min(short, max_model_len - q)
        shapes += [("verify", [], [(cached, q), (1, q)]), ("mixed+verify", [short], [(cached, q), (0, 3)])]
        if can_split:
            shapes.append(("mixed+verify+split", [long], [(cached, q)]))
    return shapes


def dummy_forward(model: Any, kv_caches: Any, lora_pool: Any, block_size: int, device: torch.device,
                  decode_lens: list[int], prefill_chunks: list[tuple[int, int]]) -> torch.Tensor:
    """One synthetic step through `model` (any rank's shard) and its LM head; returns the logits (rank 0)."""
    host = synthetic_batch(decode_lens, prefill_chunks, block_size)
    batch = to_device(host, block_size, device)
    if lora_pool is not None:
        lora_pool.context.clear()
        lora_pool.context.set_step_slots(None)       # no adapter in this step: the LM head's LoRA stays off
    hidden = model(batch.input_ids, batch.positions, kv_caches, batch.meta)                  # [T, hidden]
    return model.compute_logits(hidden[batch.logits_indices])                                # [N, vocab]


def _dummy_step(engine: Any, decode_lens: list[int], prefill_chunks: list[tuple[int, int]], label: str = "",
                check: KernelSelfCheck | None = None) -> None:
    with forward_hooks(check, engine, label) if check is not None else nullcontext():
        logits = dummy_forward(engine.model, engine.kv_caches, engine.lora_pool, engine.block_size, engine.device,
                               decode_lens, prefill_chunks)
    masks = (allocate_token_bitmask(logits.shape[0], engine.model_config.vocab_size), torch.zeros(1, dtype=torch.int64))
    if check is not None and bitmask_backend(logits) == "triton":
        check_bitmask(check, label, logits, *masks)
    else:
        apply_token_masks(logits, masks)


def lora_variants(model: Any, pool: Any) -> list[KernelVariant]:
    """The LoRA kernel variants of one rank's fused linears, on scratch stacks (no collective)."""
    if pool is None:
        return []

    if pool.context.backends.segmented != "triton":
        return []
    from adapters.lora_ops.triton_ops import SEGMENT_CONFIGS  # optional: triton

    layer0 = model.model.layers[0]
    variants: list[KernelVariant] = []
    for module in layer0.modules():
        if not isinstance(module, LoRALinear):
            continue
        for cfg in SEGMENT_CONFIGS:
            label = f"{module.group} BLOCK_M={cfg.block_m} SPLIT_K={cfg.split_k}"
            variants.append(KernelVariant("lora", label, lambda m=module, c=cfg: _segment(m, c),
                                          lambda chk, m=module, c=cfg, lb=label: _segment(m, c, lb, chk)))
        variants.append(KernelVariant("lora", f"{module.group} bgmv", lambda m=module: _bgmv(m),
                                      lambda chk, m=module: _bgmv(m, f"{m.group}", chk)))
        if pool.context.backends.decode_overlap:                      # LORAPLEX_LORA_OVERLAP's kernels
            variants.append(KernelVariant("lora", f"{module.group} bgmv delta", lambda m=module: _bgmv_delta(m),
                                          lambda chk, m=module: _bgmv_delta(m, f"{m.group}", chk)))
    for module in (model.model.embed_tokens, model.lm_head):     # LoRA on the vocabulary: segmented kernels
        if isinstance(module, (LoRAEmbedding, LoRALMHead)):
            variants += [KernelVariant("lora", f"{type(module).__name__} BLOCK_M={cfg.block_m} SPLIT_K={cfg.split_k}",
                                       lambda m=module, c=cfg: _vocab_segment(m, c)) for cfg in SEGMENT_CONFIGS]
    return variants


def _vocab_segment(module: Any, cfg: Any) -> None:
    """The embedding's expand (after its gather) or the LM head's shrink and expand, on a scratch copy of its stack."""
    from adapters.lora_ops.triton_ops import triton_add_lora, triton_expand  # optional: triton

    stack, x, y = _scratch(module)
    meta = LoRABatchMeta.build([0, -1, 0], x.device)
    if isinstance(module, LoRALMHead):
        triton_add_lora(y, x, stack, meta, 0, config=cfg)
        return
    h = torch.rand(1, meta.num_lora_tokens, stack.max_rank, device=x.device)              # [1, T_lora, R] fp32
    triton_expand(y, h, stack, meta, 0, config=cfg)


NUM_SCRATCH_ROWS = 3


def _scratch(module: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A stack shaped like the module's with random weights in slot 0 (at the pool's max rank, scaling 0.5),
    random input rows and random output rows (random: the self-check compares these launches)."""
    st = module.stack
    dev, dtype = st.lora_a.device, st.lora_a.dtype
    gen = torch.Generator(device=dev).manual_seed(0)
    ranks = torch.zeros_like(st.ranks_host)
    ranks[:, 0] = st.max_rank
    lora_a, lora_b = torch.zeros_like(st.lora_a), torch.zeros_like(st.lora_b)   # [S, slots, R, in], [slots, N, R]
    lora_a[:, 0] = torch.randn(lora_a[:, 0].shape, generator=gen, device=dev).to(dtype) / st.in_features ** 0.5
    lora_b[0] = torch.randn(lora_b[0].shape, generator=gen, device=dev).to(dtype) / st.max_rank ** 0.5
    dora = {}
    if st.dora_scale is not None:   # the pool's stacks carry DoRA's epilogue (one kernel variant with it)
        dora = dict(dora_scale=torch.ones_like(st.dora_scale), dora_shift=torch.zeros_like(st.dora_shift),
                    dora_flags=torch.zeros_like(st.dora_flags), dora_host=torch.zeros_like(st.dora_host))
    stack = LoRAStack(lora_a, lora_b, ranks.to(st.ranks.device), torch.full_like(st.scalings, 0.5),
                      st.slice_offsets, st.slice_sizes, ranks_host=ranks,
                      scalings_host=torch.full_like(st.scalings_host, 0.5), **dora)
    x = torch.randn(NUM_SCRATCH_ROWS, st.in_features, generator=gen, device=dev).to(dtype)
    y = torch.randn(NUM_SCRATCH_ROWS, module.out_features, generator=gen, device=dev).to(dtype)
    return stack, x, y


def _segment(module: Any, cfg: Any, label: str = "", check: KernelSelfCheck | None = None) -> None:
    from adapters.lora_ops.triton_ops import triton_add_lora  # optional: triton

    stack, x, y = _scratch(module)
    meta = LoRABatchMeta.build([0, -1, 0], x.device)
    if check is None:
        triton_add_lora(y, x, stack, meta, module.y_offset, config=cfg)
        return

    check_lora_segment(check, label, y, x, stack, meta, module.y_offset, cfg)


def _bgmv(module: Any, label: str = "", check: KernelSelfCheck | None = None) -> None:
    stack, x, y = _scratch(module)
    meta = DecodeLoRAMeta.build([0, -1, 0], x.device)                                       # [B] = 3 rows
    if check is None:
        triton_bgmv_add_lora(y, x, stack, meta, module.y_offset)
        return

    check_bgmv(check, label, y, x, stack, meta, module.y_offset)


def _bgmv_delta(module: Any, label: str = "", check: KernelSelfCheck | None = None) -> None:
    stack, x, y = _scratch(module)
    meta = DecodeLoRAMeta.build([0, -1, 0], x.device)                                       # [B] = 3 rows
    if check is None:
        delta = delta_buffer(stack, meta, x.device)                                         # [B, N] float32
        triton_bgmv_delta(x, stack, meta, delta)
        triton_bgmv_add_delta(y, delta, stack, meta, module.y_offset)
        return
    check_bgmv_delta(check, label, y, x, stack, meta, module.y_offset)


def kernel_variants(engine: Any) -> list[KernelVariant]:
    """Every Triton kernel variant this engine can launch outside the decode graphs (empty on a plain CPU)."""
    forwards = [KernelVariant("forward", name, lambda d=d, p=p: _dummy_step(engine, d, p),
                              lambda chk, d=d, p=p, n=name: _dummy_step(engine, d, p, n, chk))
                for name, d, p in forward_shapes(engine)]
    draft = engine.spec.draft
    if draft is not None and hasattr(draft, "kv_caches"):   # draft_model (tests may plug in other proposers)
        forwards += [KernelVariant("draft", name, lambda d=d, p=p: dummy_forward(
                         draft.model, draft.kv_caches, None, draft.block_size, draft.device, d, p))
                     for name, d, p in model_shapes(draft.model, draft.cfg.num_kv_heads, draft.block_size,
                                                    draft.max_positions, draft.device,
                                                    engine.spec.num_speculative_tokens)]
    quant = [KernelVariant("quant_gemm", label, run)
             for label, run in quant_gemm_warmups(engine.model, engine.device,
                                                  engine.config.scheduler.max_num_batched_tokens)]
    return forwards + quant + lora_variants(engine.model, engine.lora_pool)


def run_warmup(engine: Any, progress: ProgressFn | None = None, selfcheck: bool | None = None) -> WarmupReport:
    """Launches every variant (and, with the self-check on, compares each with its torch path: raises
    `KernelSelfCheckError` on a mismatch), then captures the decode graphs; reports counts and seconds.
    `selfcheck`: None = LORAPLEX_KERNEL_SELFCHECK / the device decide. Later Triton compiles count as stalls
    (`core/startup/kernel_compiles.py`)."""
    if engine.device.type == "cuda":
        COMPILES.install()
    with COMPILES.warming_up():
        return _run_warmup(engine, progress, selfcheck)


def _run_warmup(engine: Any, progress: ProgressFn | None, selfcheck: bool | None) -> WarmupReport:
    start = time.monotonic()
    compiles_before = COMPILES.total
    variants = kernel_variants(engine)
    check = KernelSelfCheck() if (selfcheck_enabled(engine.device) if selfcheck is None else selfcheck) else None
    # the workers run the same dummy forwards (collectives pair up), then their LoRA
    engine.executor.warmup_forwards([(d, p) for _, d, p in forward_shapes(engine)])
    with torch.inference_mode():
        for i, variant in enumerate(variants):
            if check is not None and variant.check is not None:
                variant.check(check)
            else:
                variant.run()
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
            if progress is not None:
                progress(i + 1, len(variants), time.monotonic() - start)
        selfcheck_seconds = time.monotonic() - start
        if check is not None:
            check.raise_on_failure(engine.device)
            log.info("kernel self-check: %d Triton kernel outputs match the torch path (%d variants, %.1f s "
                     "with their launches)", len(check.checks), len(variants), selfcheck_seconds)
        num_graphs = engine.capture_decode_graphs()
    return WarmupReport(num_variants=len(variants), num_graphs=num_graphs, seconds=time.monotonic() - start,
                        num_jit_compiles=COMPILES.total - compiles_before,
                        num_kernel_checks=0 if check is None else len(check.checks),
                        selfcheck_seconds=0.0 if check is None else selfcheck_seconds)
