"""The fused decode LoRA as a delta computed beside the base GEMM (adapters/lora_ops/bgmv_overlap.py,
LORAPLEX_LORA_OVERLAP) against the fused kernels it replaces, on `kernel_device()`: the delta, then its add and
the DoRA rescaling, must give the fused expand's output bit for bit (same expressions in the same order), read
nothing the expand did not write (the delta starts as NaN), and leave base rows, padding and columns outside the
linear's slices untouched. Through `LoRALinear` the wrapper takes the delta path only when its backends ask, and
on a GPU inside a CUDA graph with the side stream (the test of this file the GPU run's tests stage runs)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from adapters.layers.dims import BaseModelDims, fused_groups  # noqa: E402
from adapters.layers.lora_linear import LoRALinear  # noqa: E402
from adapters.lora_ops import LoRABackends, LoRAStack  # noqa: E402
from adapters.lora_ops.bgmv import DecodeLoRAMeta, bgmv_config, triton_bgmv_add_lora  # noqa: E402
from adapters.lora_ops import bgmv_overlap  # noqa: E402
from adapters.lora_ops.bgmv_overlap import delta_buffer, triton_bgmv_add_delta, triton_bgmv_delta  # noqa: E402
from adapters.lora_ops.graph_meta import GraphLoRABuffers  # noqa: E402
from adapters.slots.slot_pool import LoRASlotPool  # noqa: E402
from adapters.adapter import LoRAAdapter, LoRAModule  # noqa: E402
from lora_nan_stacks import DEVICE, nan_stack  # noqa: E402

CASES = [  # (slots, r_max, in, outs, ranks per slice x slot)
    (4, 16, 48, (32, 16, 16), [[16, 8, 4, 0], [16, 8, 0, 2], [1, 8, 4, 16]]),   # fused qkv-like, a rank-0 slice
    (3, 64, 40, (24,), [[64, 8, 33]]),                                           # one slice, rank up to 64
    (2, 8, 100, (70, 70), [[8, 3], [5, 8]]),                                     # odd widths, gate_up-like
]


def with_dora(stack: LoRAStack, flags: list[int], seed: int) -> LoRAStack:
    """`stack` with DoRA rescaling on the flagged slots (random scale near 1 and shift), as the slot pool keeps it."""
    g = torch.Generator().manual_seed(seed)
    slots, n = stack.num_slots, stack.lora_b.shape[1]
    f = torch.tensor(flags, dtype=torch.int32)
    scale = torch.where(f[:, None] > 0, 1 + 0.3 * torch.randn(slots, n, generator=g), torch.ones(slots, n))
    shift = torch.where(f[:, None] > 0, 0.2 * torch.randn(slots, n, generator=g), torch.zeros(slots, n))
    return LoRAStack(stack.lora_a, stack.lora_b, stack.ranks, stack.scalings, stack.slice_offsets,
                     stack.slice_sizes, ranks_host=stack.ranks_host, scalings_host=stack.scalings_host,
                     dora_scale=scale.to(DEVICE), dora_shift=shift.to(DEVICE), dora_flags=f.to(DEVICE),
                     dora_host=f > 0)


def both_paths(y0: torch.Tensor, x: torch.Tensor, stack: LoRAStack, meta: DecodeLoRAMeta, y_offset: int,
               k_split_cols: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = bgmv_config(stack, meta.num_tokens, k_split_cols=k_split_cols, block_m=meta.group_rows)
    fused = y0.clone()
    triton_bgmv_add_lora(fused, x, stack, meta, y_offset, config=cfg)
    beside = y0.clone()
    delta = delta_buffer(stack, meta, x.device).fill_(float("nan"))    # unwritten entries must never be read
    triton_bgmv_delta(x, stack, meta, delta, config=cfg)
    triton_bgmv_add_delta(beside, delta, stack, meta, y_offset)
    return fused, beside


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("group_rows,k_split_cols,add_block_n", [(16, None, 1024), (16, 16, 16), (64, 16, 16)])
def test_the_delta_path_is_the_fused_path_bit_for_bit(case: int, dora: bool, group_rows: int,
                                                      k_split_cols: int | None, add_block_n: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows of every slot, a 40-row chunk of slot 0 and base rows, into the middle columns of a wider
    output (the linear's slices at an offset), with and without K splits and DoRA slots, the add's columns in one
    tile or (16-column tiles, as a served model's 4,096-14,336-column slices are in 1,024-column ones) in several
    chunks each walking several tiles: equal to the fused kernels bit for bit; base rows and the columns outside
    the slices untouched."""
    monkeypatch.setattr(bgmv_overlap, "ADD_BLOCK_N", add_block_n)
    num_slots, r_max, in_f, outs, ranks = CASES[case]
    stack = nan_stack(num_slots, r_max, in_f, outs, ranks, seed=40 + case)
    if dora:
        stack = with_dora(stack, [1, 0, 1, 0][:num_slots], seed=case)
    rng = np.random.default_rng(case)
    slots = np.concatenate([np.zeros(40, np.int64), rng.integers(-1, num_slots, 21), [num_slots - 1, -1]])
    g = torch.Generator().manual_seed(case)
    n, off = sum(outs), 5
    x = torch.randn(len(slots), in_f, generator=g).to(DEVICE)
    y0 = torch.randn(len(slots), n + off + 3, generator=g).to(DEVICE)
    meta = DecodeLoRAMeta.build(slots, DEVICE, group_rows=group_rows)
    fused, beside = both_paths(y0, x, stack, meta, off, k_split_cols)
    assert torch.equal(beside, fused)
    assert not torch.equal(fused, y0), "the case adds nothing: it proves nothing"
    base = torch.from_numpy(slots < 0).to(DEVICE)
    assert torch.equal(beside[base], y0[base]), "base rows must be untouched"
    assert torch.equal(beside[:, :off], y0[:, :off]) and torch.equal(beside[:, off + n:], y0[:, off + n:])


def test_bf16_outputs_through_the_graph_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 weights and activations over the graph buffers' padded rows, the add's columns in 16-column tiles:
    equal to the fused kernels bit for bit, padding rows untouched."""
    monkeypatch.setattr(bgmv_overlap, "ADD_BLOCK_N", 16)
    num_slots, r_max, in_f, outs, ranks = CASES[0]
    stack = with_dora(nan_stack(num_slots, r_max, in_f, outs, ranks, dtype=torch.bfloat16, seed=9), [0, 1, 0, 1], 9)
    bufs = GraphLoRABuffers(16, num_slots, DEVICE)
    slots = np.array([2, -1, 0, 2, 3, 1, 0, 3, 3])
    bufs.fill(slots, 12)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(12, in_f, generator=g).to(torch.bfloat16).to(DEVICE)
    y0 = torch.randn(12, sum(outs), generator=g).to(torch.bfloat16).to(DEVICE)
    fused, beside = both_paths(y0, x, stack, bufs.meta(12), 0)
    assert torch.equal(beside, fused)
    assert torch.equal(beside[9:], y0[9:]) and torch.equal(beside[1], y0[1])


DIMS = BaseModelDims(hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=1,
                     vocab_size=64)


def wrapped_qkv(overlap: bool, dtype: torch.dtype = torch.float32) -> tuple[LoRALinear, LoRASlotPool]:
    """A q/k/v linear over a two-slot pool on the kernels (q and v of adapter a, rank 8; v of b, rank 4), slot 1
    with a DoRA rescaling of the linear's output (random, as the pool's DoRA norms would set it)."""
    pool = LoRASlotPool(2, 8, DIMS, DEVICE, dtype, backends=LoRABackends("triton", "triton", overlap=overlap))
    g = torch.Generator().manual_seed(3)
    grp = fused_groups(DIMS)["qkv"]
    for name, targets, rank in (("a", ("q_proj", "v_proj"), 8), ("b", ("v_proj",), 4)):
        mods = {(0, t): LoRAModule(torch.randn(rank, 32, generator=g),
                                   torch.randn(dict(zip(grp.slices, grp.slice_sizes))[t], rank, generator=g), 1.5)
                for t in targets}
        pool.load(name, LoRAAdapter(name, name, mods))
    base = torch.nn.Linear(32, grp.out_features, bias=True)
    torch.nn.init.normal_(base.weight, generator=g)
    torch.nn.init.normal_(base.bias, generator=g)
    layer = LoRALinear(base.to(DEVICE, dtype), grp.slice_spec(), pool, 0)
    st = layer.stack
    st.dora_scale[1] = (1 + 0.3 * torch.randn(grp.out_features, generator=g)).to(DEVICE)
    st.dora_shift[1] = (0.2 * torch.randn(grp.out_features, generator=g)).to(DEVICE)
    st.dora_flags[1], st.dora_host[1] = 1, True
    return layer, pool


def test_the_wrapper_takes_the_delta_path_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """With `overlap` the q/k/v wrapper's decode batch runs the delta path (on a GPU: on the side stream), and its
    output equals the fused path's bit for bit; the grouped metadata of a prefill keeps the segmented path; without
    `overlap` the delta path never runs."""
    calls: list[str] = []
    import adapters.layers.lora_linear as ll
    real = ll.triton_bgmv_delta
    monkeypatch.setattr(ll, "triton_bgmv_delta", lambda *a, **k: (calls.append("delta"), real(*a, **k))[1])
    slots = np.array([0, 1, -1, 0, 1, 1, -1, 0])
    x = torch.randn(len(slots), 32, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    outs = {}
    for overlap in (False, True):
        layer, pool = wrapped_qkv(overlap)
        pool.context.set_meta(DecodeLoRAMeta.build(slots, DEVICE))
        with torch.no_grad():
            outs[overlap] = layer(x)
        assert calls == (["delta"] if overlap else []), (overlap, calls)
        if overlap:
            pool.context.set_batch(slots)                       # a prefill's grouped metadata
            with torch.no_grad():
                layer(x)
            assert calls == ["delta"]
    assert torch.equal(outs[True], outs[False])


def test_steps_past_the_overlap_bound_keep_the_fused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of more than OVERLAP_MAX_TOKENS rows (a long mixed-step graph) takes the fused path: the delta's
    float32 round trip costs more bytes there than the launches' latency it hides. Up to the bound, the delta
    path; both give the same output bit for bit."""
    from adapters.lora_ops.backends import OVERLAP_MAX_TOKENS

    calls: list[int] = []
    import adapters.layers.lora_linear as ll
    real = ll.triton_bgmv_delta
    monkeypatch.setattr(ll, "triton_bgmv_delta", lambda x, *a, **k: (calls.append(x.shape[0]), real(x, *a, **k))[1])
    layer, pool = wrapped_qkv(True)
    rng = np.random.default_rng(5)
    for rows in (OVERLAP_MAX_TOKENS, OVERLAP_MAX_TOKENS + 1):
        slots = rng.integers(-1, 2, size=rows)
        x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
        pool.context.set_meta(DecodeLoRAMeta.build(slots, DEVICE))
        assert pool.context.backends.overlaps(pool.context.meta) == (rows <= OVERLAP_MAX_TOKENS)
        with torch.no_grad():
            got = layer(x)
        fused, _ = wrapped_qkv(False)
        fused.context.set_meta(DecodeLoRAMeta.build(slots, DEVICE))
        with torch.no_grad():
            assert torch.equal(got, fused(x))
    assert calls == [OVERLAP_MAX_TOKENS], calls


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs and streams need a GPU")
def test_the_side_stream_inside_a_cuda_graph_equals_the_fused_path() -> None:
    """On a GPU: the wrapper captured in a CUDA graph with `overlap` (the delta forked onto the side stream and
    joined before the add) replays the fused path's output bit for bit, for a new mix of slots filled into the
    graph's buffers after capture, bf16 as served."""
    bufs = GraphLoRABuffers(16, 2, DEVICE)
    x = torch.randn(16, 32, device=DEVICE, dtype=torch.bfloat16)
    ref_layer, ref_pool = wrapped_qkv(False, torch.bfloat16)
    layer, pool = wrapped_qkv(True, torch.bfloat16)
    bufs.fill(np.array([0, 1, 0, -1, 1, 1, 0, 0, 1, -1, 0, 1]), 16)
    pool.context.set_meta(bufs.meta(16))
    with torch.no_grad():
        layer(x)                                               # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
    for slots in (np.array([1, 1, 0, 0, -1, 1, 0, 1, 1, 0, -1, 0, 1, 0]), np.array([0] * 16)):
        bufs.fill(slots, 16)
        x.copy_(torch.randn(16, 32, device=DEVICE, dtype=torch.bfloat16))
        graph.replay()
        ref_pool.context.set_meta(DecodeLoRAMeta.build(np.concatenate([slots, [-1] * (16 - len(slots))]), DEVICE))
        with torch.no_grad():
            want = ref_layer(x)
        torch.cuda.synchronize()
        assert torch.equal(out, want)
