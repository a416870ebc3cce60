"""The per-family checks of the start-up kernel self-check (`core/startup/kernel_selfcheck.py`).

Each check runs the Triton path on random inputs laid out like the warm-up's real launch (same storage
offset, strides, dtype: the same compiled variant) and the torch path on the same inputs, and records the
comparison. Forward kernels (attention, fused ops) are checked from inside the warm-up's dummy forwards
(`forward_hooks` wraps them for one forward; the first call of each op is checked, every layer launches the
same variants); LoRA and the bitmask apply are checked on the warm-up's own scratch launches.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from adapters.lora_ops import bgmv, bgmv_overlap
from adapters.lora_ops.bgmv_split import torch_bgmv_expand, torch_bgmv_shrink
from adapters.lora_ops.torch_ops import torch_expand, torch_shrink
from core.attention.torch_backend import TorchAttentionBackend
from core.models import fused_ops
from core.startup.kernel_selfcheck import KernelSelfCheck
from grammar.matching import bitmask_triton
from grammar.matching.bitmask import apply_token_bitmask_torch_


def random_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random tensor with t's shape, strides, storage offset and dtype (so the same pointer alignment)."""
    if t.numel() == 0:
        return t.clone()
    extent = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    base = torch.randn(extent, generator=gen, device=t.device, dtype=torch.float32).to(t.dtype)   # [extent]
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


def generator(device: torch.device, seed: int = 0) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@contextmanager
def forward_hooks(check: KernelSelfCheck, engine: Any, label: str) -> Iterator[None]:
    """While active, the first attention and fused-op call of each kind in a forward is also checked."""
    from core.attention.triton_backend import TritonAttentionBackend  # optional: triton

    backend = engine.model.model.layers[0].self_attn.backend
    done: set[str] = set()
    gen = generator(engine.device)
    restore: list[Callable[[], None]] = []
    if isinstance(backend, TritonAttentionBackend):
        triton_forward, reference = backend.forward, TorchAttentionBackend()

        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: Any, scale: float, window: int | None = None,
                      softcap: float | None = None) -> torch.Tensor:
            # each layer variant (sliding window, soft-capping: Gemma, Mistral, Qwen3 layer_types) once
            key = f"attention window={window} softcap={softcap}"
            if key not in done:
                done.add(key)
                extra = "" if window is None and softcap is None else f", window {window}, softcap {softcap}"
                _check_attention(check, label + extra, triton_forward, reference, gen, q, k, v, k_cache, v_cache,
                                 meta, scale, window, softcap)
            return triton_forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap)

        backend.forward = attention   # type: ignore[method-assign]
        restore.append(lambda: delattr(backend, "forward"))
    originals = {name: getattr(fused_ops, name) for name in ("rms_norm", "rotary", "silu_and_mul")}

    def torch_path(fn: Callable[..., Any], *args: Any) -> Any:
        use_triton = fused_ops.use_triton
        fused_ops.use_triton = lambda t: False   # type: ignore[assignment]
        try:
            return fn(*args)
        finally:
            fused_ops.use_triton = use_triton    # type: ignore[assignment]

    def fused(name: str, randomized: tuple[int, ...], outputs: tuple[str, ...]) -> Callable[..., Any]:
        fn = originals[name]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if kwargs:
                return fn(*args, **kwargs)
            residual = name == "rms_norm" and len(args) > 3 and args[3] is not None
            key = f"_{name}_kernel{' (residual)' if residual else ''}"
            if key not in done and fused_ops.use_triton(args[0]):
                done.add(key)
                rand = [random_like(a, gen) if i in randomized and a is not None else a for i, a in enumerate(args)]
                got, want = fn(*rand), torch_path(fn, *rand)
                got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
                for out, g, w in zip(outputs, got, want):
                    check.compare(f"{key} {out} [{label}]", "fused", g, w, args[0].dtype)
            return fn(*args)
        return wrapper

    for name, randomized, outputs in (("rms_norm", (0, 3), ("out", "sum")), ("rotary", (0, 1), ("q", "k")),
                                      ("silu_and_mul", (0,), ("out",))):
        setattr(fused_ops, name, fused(name, randomized, outputs))
        restore.append(lambda n=name: setattr(fused_ops, n, originals[n]))
    try:
        yield
    finally:
        for undo in restore:
            undo()


def _check_attention(check: KernelSelfCheck, label: str, triton_forward: Callable[..., torch.Tensor],
                     reference: Any, gen: torch.Generator, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any, scale: float, window: int | None = None,
                     softcap: float | None = None) -> None:
    """The KV store and the attention output on random q/k/v and random blocks (the warm-up's dummy steps
    read and write only their own blocks, before any request holds one)."""
    q, k, v = (random_like(t, gen) for t in (q, k, v))
    tables = [meta.decode_block_tables.reshape(-1), *meta.prefill_block_tables,
              torch.div(meta.slot_mapping, meta.block_size, rounding_mode="floor")]
    blocks = torch.unique(torch.cat([t.to(k_cache.device, torch.int64) for t in tables]))   # [nb]
    for cache in (k_cache, v_cache):
        cache[blocks] = torch.randn(cache[blocks].shape, generator=gen, device=cache.device).to(cache.dtype)
    got = triton_forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap)            # [T, H, D]
    stored = (k_cache[blocks].clone(), v_cache[blocks].clone())
    want = reference.forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap)   # stores the same K/V again
    for name, cache, before in (("K", k_cache, stored[0]), ("V", v_cache, stored[1])):
        check.compare(f"store_kv_kernel ({name}) [{label}]", "attention", before, cache[blocks], q.dtype, exact=True)
    kernels = "paged_attention_kernel+reduce_splits_kernel" if "split" in label else "paged_attention_kernel"
    check.compare(f"{kernels} [{label}]", "attention", got, want, q.dtype)


def check_bitmask(check: KernelSelfCheck, label: str, logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: torch.Tensor) -> None:
    """The bitmask apply as the engine calls it (constrained rows), on random logits and a random mask shaped
    like the warm-up's."""
    gen = generator(logits.device, 1)
    mask = torch.randint(-(2 ** 31), 2 ** 31 - 1, tuple(bitmask.shape), generator=gen, device=logits.device,
                         dtype=torch.int64).to(torch.int32)                                 # [N, W]
    got = random_like(logits, gen)                                                           # [N, V]
    want = got.clone()
    rows = rows.to(logits.device)
    bitmask_triton.apply_token_bitmask_triton_(got, mask, rows)   # via the module: the self-check tests replace it
    apply_token_bitmask_torch_(want, mask, rows)
    check.compare(f"_apply_bitmask_kernel [{label}]", "bitmask", got, want, logits.dtype, exact=True)


def check_lora_segment(check: KernelSelfCheck, label: str, y: torch.Tensor, x: torch.Tensor, stack: Any,
                       meta: Any, y_offset: int, config: Any) -> None:
    """Segmented shrink (vs torch_shrink), then expand of the same h (vs torch_expand), at one table config."""
    from adapters.lora_ops.triton_ops import triton_expand, triton_shrink  # optional: triton

    h = triton_shrink(x, stack, meta, config=config)                                         # [S, T_lora, R]
    h_ref = torch_shrink(x, stack, meta)                                                     # [S, T_lora, R]
    check.compare(f"lora_shrink_kernel [{label}]", "lora", h, h_ref, x.dtype)
    got, want = y.clone(), y.clone()
    triton_expand(got, h_ref, stack, meta, y_offset, config=config)
    torch_expand(want, h_ref, stack, meta, y_offset)
    check.compare(f"lora_expand_kernel [{label}]", "lora", got, want, x.dtype)


def check_bgmv(check: KernelSelfCheck, label: str, y: torch.Tensor, x: torch.Tensor, stack: Any, meta: Any,
               y_offset: int) -> None:
    """The BGMV halves (`bgmv_split`): shrink vs the torch shrink on the rows with a slot, expand of the same
    h vs the torch expand (rows without a slot must stay untouched)."""
    rank = stack.max_rank
    live = torch.nonzero(meta.row_slots >= 0).squeeze(1)                                    # [n]
    h = bgmv.triton_bgmv_shrink(x, stack, meta)                                              # [splits, S, B, BR]
    h_ref = torch_bgmv_shrink(x, stack, meta)                                                # [1, S, B, R]
    check.compare(f"bgmv_shrink_kernel [{label}]", "lora", h.sum(0)[:, live, :rank], h_ref[0][:, live], x.dtype)
    h_in = torch.zeros_like(h)                                                               # [splits, S, B, BR]
    h_in[0, :, :, :rank] = h_ref[0]
    got, want = y.clone(), y.clone()
    bgmv.triton_bgmv_expand(got, h_in, stack, meta, y_offset)   # via the module: the self-check tests replace it
    torch_bgmv_expand(want, h_ref, stack, meta, y_offset)
    check.compare(f"bgmv_expand_kernel [{label}]", "lora", got, want, x.dtype)


def check_bgmv_delta(check: KernelSelfCheck, label: str, y: torch.Tensor, x: torch.Tensor, stack: Any, meta: Any,
                     y_offset: int) -> None:
    """The LoRA delta beside the base GEMM (LORAPLEX_LORA_OVERLAP, `bgmv_overlap`): its shrink, its expand into the
    delta and its add, against the torch shrink and expand of the same rows."""
    got, want = y.clone(), y.clone()
    delta = bgmv_overlap.delta_buffer(stack, meta, x.device)                                 # [B, N] float32
    bgmv_overlap.triton_bgmv_delta(x, stack, meta, delta)
    bgmv_overlap.triton_bgmv_add_delta(got, delta, stack, meta, y_offset)
    torch_bgmv_expand(want, torch_bgmv_shrink(x, stack, meta), stack, meta, y_offset)
    check.compare(f"bgmv_add_delta_kernel [{label}]", "lora", got, want, x.dtype)
