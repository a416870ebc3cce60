"""W4A16 / W8A16 GEMM for CUDA that dequantizes inside the kernel: y = x @ ((code - zero) * scale)^T.

The packed weight is read once per launch (per split of K, per token tile): a program loads its [BLOCK_N,
BLOCK_K / codes-per-word] tile of int32 words in one wide load (4-bit: 8 codes a word; 8-bit: the uint8 codes read
as int32 words of 4), unpacks every code in registers (shift and mask, reshaped to [BLOCK_N, BLOCK_K]), loads one
scale and one zero point per (output row, group) of the tile, dequantizes in registers and feeds `tl.dot` with
fp32 accumulation (fp32 activations: exact fp32 dots, never TF32). The float weight never exists in memory,
except for prefill-sized batches (T >= gemm_plan.DEQUANT_MIN_TOKENS), where `_dequant_kernel` writes it once into
a scratch buffer of the model dtype and cuBLAS multiplies (cheaper there by bytes and FLOPs: gemm_plan.py).
Split-K (decode sizes, few output tiles): each split writes fp32 partials, `_split_k_sum_kernel` adds them in
split order (deterministic) and casts. Tiles, splits and the path come from the fixed table of gemm_plan.py, keyed
by the token-count bucket and the layer shape, so the variants are few and the start-up warm-up (warmup.py)
compiles every one. Act-order layers arrive with their input columns sorted by group (act_order.py): the kernel
never gathers by g_idx; `perm` permutes x's columns to match, once per call.
Tested (compiled on a GPU, in the Triton interpreter without one) against the torch dequantize-then-matmul path,
with the loads of the packed weight counted (tests/test_core/quant/test_quant_triton.py, test_quant_gemm_loads.py).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from core.environment.backends import kernel_backend
from core.quant.gemm_plan import Plan, gemm_plan

try:  # optional: CPU-only installs use the torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None

# ints that change with the batch (or per layer) and must not pick a new compiled variant (== 1, % 16)
_RUNTIME_INTS = ["M", "numel", "group_size", "num_groups", "k_per_split", "group_step"]


def _jit(fn: Callable[..., Any]) -> Any:
    if triton is None:
        return fn
    params = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    return triton.jit(do_not_specialize=[p for p in _RUNTIME_INTS if p in params])(fn)


def use_triton(x: torch.Tensor) -> bool:
    """CUDA tensors when triton imports; LORAPLEX_QUANT_GEMM=torch|triton overrides (core/environment/backends.py;
    triton off CUDA needs TRITON_INTERPRET=1: the kernel runs in the interpreter; tests only)."""
    return kernel_backend("quant_gemm", x.device.type) == "triton"


def plan_for(num_tokens: int, qweight: torch.Tensor, num_groups: int, num_bits: int, in_features: int,
             out_features: int) -> Plan | None:
    """The launch plan, or None where this kernel cannot serve the layer (the caller takes the torch path)."""
    if (num_bits == 4) != (qweight.dtype == torch.int32) or (num_bits == 8 and qweight.dtype != torch.uint8):
        return None                 # e.g. the CPU int8 kernel's signed copy of the codes
    return gemm_plan(num_tokens, in_features, out_features, num_bits, -(-in_features // num_groups))


if triton is not None:
    @triton.jit
    def _codes(qw_ptr, offs_n, n_mask, k0, num_words, stride_qn, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
        """The codes [BLOCK_N, BLOCK_K] (int32) of input columns k0.. : each packed word loaded once, unpacked by
        shift and mask in registers."""
        PACK: tl.constexpr = 32 // BITS
        WORDS: tl.constexpr = BLOCK_K // PACK
        offs_w = tl.max_contiguous(tl.multiple_of(k0 // PACK + tl.arange(0, WORDS), WORDS), WORDS)   # wide loads
        words = tl.load(qw_ptr + offs_n[:, None] * stride_qn + offs_w[None, :],
                        mask=n_mask[:, None] & (offs_w[None, :] < num_words), other=0)          # [BN, WORDS]
        shifts = tl.arange(0, PACK) * BITS
        codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)                # [BN, WORDS, PACK]
        return tl.reshape(codes, (BLOCK_N, BLOCK_K))                                            # [BN, BK]

    @triton.jit
    def _group_params(s_ptr, z_ptr, offs_n, n_mask, g0, num_groups, stride_sn, stride_zn, GROUPS: tl.constexpr):
        """Scales and 2**23 + zero point (fp32, exact) [BLOCK_N, GROUPS] of groups g0..: one per (row, group)."""
        offs_g = g0 + tl.arange(0, GROUPS)
        mask = n_mask[:, None] & (offs_g[None, :] < num_groups)
        scale = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :], mask=mask, other=0.0)
        zero = tl.load(z_ptr + offs_n[:, None] * stride_zn + offs_g[None, :], mask=mask, other=0)
        return scale.to(tl.float32), zero.to(tl.float32) + 8388608.0

    @triton.jit
    def _dequant(codes, scale, zero_2p23, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr,
                 OUT_DTYPE: tl.constexpr):
        """(code - zero) * scale per (row, group) of the tile, rounded once to OUT_DTYPE: [BLOCK_N, BLOCK_K].
        No integer -> float conversion per code (a quarter-rate instruction on the GPU): the code ORed into the
        mantissa of 2**23 is the float 2**23 + code, exactly; minus 2**23 + zero it is code - zero, exactly."""
        c = tl.reshape(codes, (BLOCK_N, GROUPS, BLOCK_K // GROUPS))                             # [BN, G, GS]
        c_2p23 = (c | 0x4B000000).to(tl.float32, bitcast=True)                                  # 2**23 + code
        w = (c_2p23 - zero_2p23[:, :, None]) * scale[:, :, None]
        return tl.reshape(w, (BLOCK_N, BLOCK_K)).to(OUT_DTYPE)                                  # [BN, BK]

    @triton.jit
    def _dot(acc, x, w):
        if x.dtype == tl.float32:   # exact fp32 (a GPU's default for fp32 dots is TF32), as the torch path
            return acc + tl.dot(x, tl.trans(w), input_precision="ieee")
        return acc + tl.dot(x, tl.trans(w))      # bf16 / fp16: the tensor cores, fp32 accumulation

    @_jit
    def _wq_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_zn,
                        stride_ys, stride_ym, group_size, num_groups, k_per_split, group_step,
                        BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUPS_PER_TILE: tl.constexpr, HOIST_GROUPS: tl.constexpr, SPLIT_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        num_words = K // (32 // BITS)
        dtype = x_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = tl.multiple_of(pid_s * k_per_split, BLOCK_K)          # k_per_split: a multiple of BLOCK_K
        k_end = tl.minimum(k_start + k_per_split, K)
        if HOIST_GROUPS:     # a group spans several steps: its scales and zeros loaded once, before them
            for g_start in range(k_start, k_end, group_step):
                scale, zero = _group_params(s_ptr, z_ptr, offs_n, n_mask, g_start // group_size, num_groups,
                                            stride_sn, stride_zn, 1)                             # [BN, 1]
                for k0 in range(g_start, tl.minimum(g_start + group_step, k_end), BLOCK_K):
                    k0 = tl.multiple_of(k0, BLOCK_K)
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                                mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0)         # [BM, BK]
                    codes = _codes(qw_ptr, offs_n, n_mask, k0, num_words, stride_qn, BITS, BLOCK_N, BLOCK_K)
                    acc = _dot(acc, x, _dequant(codes, scale, zero, BLOCK_N, BLOCK_K, 1, dtype))
        else:                # whole groups in every step: one load of each of them per step
            for k0 in range(k_start, k_end, BLOCK_K):
                k0 = tl.multiple_of(k0, BLOCK_K)
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                            mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0)             # [BM, BK]
                codes = _codes(qw_ptr, offs_n, n_mask, k0, num_words, stride_qn, BITS, BLOCK_N, BLOCK_K)
                scale, zero = _group_params(s_ptr, z_ptr, offs_n, n_mask, k0 // group_size, num_groups,
                                            stride_sn, stride_zn, GROUPS_PER_TILE)               # [BN, G]
                acc = _dot(acc, x, _dequant(codes, scale, zero, BLOCK_N, BLOCK_K, GROUPS_PER_TILE, dtype))
        out = y_ptr + pid_s * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]   # SPLIT_K > 1: fp32 partials
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    @_jit
    def _split_k_sum_kernel(p_ptr, y_ptr, numel, slice_stride, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        """y = sum of the SPLIT_K fp32 partial slices [numel] (slice_stride apart: a multiple of 16, so the loads are
        wide and the variant is the same for every token count), in split order (deterministic), cast to y's dtype."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        in_slice = offs < slice_stride                  # the padded tail is read (never stored): wide loads
        acc = tl.load(p_ptr + offs, mask=in_slice, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(p_ptr + s * slice_stride + offs, mask=in_slice, other=0.0)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=offs < numel)

    @_jit
    def _dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, stride_qn, stride_sn, stride_zn, stride_wn,
                        group_size, num_groups, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUPS_PER_TILE: tl.constexpr):
        """The float weight [N, K] in w's dtype (prefill: written once, then cuBLAS)."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        n_mask = offs_n < N
        codes = _codes(qw_ptr, offs_n, n_mask, k0, K // (32 // BITS), stride_qn, BITS, BLOCK_N, BLOCK_K)
        scale, zero = _group_params(s_ptr, z_ptr, offs_n, n_mask, k0 // group_size, num_groups, stride_sn,
                                    stride_zn, GROUPS_PER_TILE)                                  # [BN, G]
        w = _dequant(codes, scale, zero, BLOCK_N, BLOCK_K, GROUPS_PER_TILE, w_ptr.dtype.element_ty)   # [BN, BK]
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tl.store(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], w, mask=n_mask[:, None] & (offs_k[None, :] < K))

SUM_BLOCK = 1024
DEQUANT_BLOCK_N = 32


def _words(qweight: torch.Tensor, num_bits: int) -> torch.Tensor:
    """The packed weight as int32 words [out, in / codes-per-word] (8-bit codes: 4 bytes a word, no copy)."""
    return qweight if num_bits == 4 else qweight.view(torch.int32)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, num_bits: int, in_features: int,
               out_features: int, plan: Plan, dtype: torch.dtype) -> torch.Tensor:
    """The float weight [out, in] in `dtype`, written by `_dequant_kernel`."""
    words = _words(qweight, num_bits)
    w = torch.empty(out_features, in_features, dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(out_features, DEQUANT_BLOCK_N), triton.cdiv(in_features, plan.tiles.block_k))
    _dequant_kernel[grid](words, scales, zeros, w, out_features, in_features, words.stride(0), scales.stride(0),
                          zeros.stride(0), w.stride(0), -(-in_features // scales.shape[1]), scales.shape[1],
                          BITS=num_bits, BLOCK_N=DEQUANT_BLOCK_N, BLOCK_K=plan.tiles.block_k,
                          GROUPS_PER_TILE=plan.groups_per_tile)
    return w


def wq_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, num_bits: int,
              in_features: int, out_features: int, plan: Plan, perm: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] -> [T, out] through the dequantizing kernel (CUDA, or the interpreter in tests). `plan`: from
    `plan_for` (not None); `perm`: act-order layers' column order (x's columns are permuted to the weight's)."""
    assert triton is not None, "triton is not installed"
    x = (x if perm is None else x.index_select(1, perm)).contiguous()                 # [T, in]
    if plan.kind == "dequant":
        return F.linear(x, dequantize(qweight, scales, zeros, num_bits, in_features, out_features, plan, x.dtype))
    num_tokens = x.shape[0]
    words = _words(qweight, num_bits)
    y = torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    numel = num_tokens * out_features
    slice_stride = -(-numel // 16) * 16                  # divisible by 16 whatever T: one variant for every T
    out = y if plan.split_k == 1 else torch.empty(plan.split_k, slice_stride, dtype=torch.float32,
                                                  device=x.device)                   # [splits, T x out (padded)]
    t = plan.tiles
    _wq_gemm_kernel[plan.grid(num_tokens, out_features)](
        x, words, scales, zeros, out, num_tokens, out_features, in_features, x.stride(0), words.stride(0),
        scales.stride(0), zeros.stride(0), slice_stride, out_features,
        -(-in_features // scales.shape[1]), scales.shape[1], plan.k_per_split, max(plan.group_step, 1),
        BITS=num_bits, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        GROUPS_PER_TILE=plan.groups_per_tile, HOIST_GROUPS=plan.group_step > 0, SPLIT_K=plan.split_k, num_warps=t.num_warps, num_stages=t.num_stages)
    if plan.split_k > 1:
        _split_k_sum_kernel[(triton.cdiv(numel, SUM_BLOCK),)](out, y, numel, slice_stride, SPLIT_K=plan.split_k,
                                                              BLOCK=SUM_BLOCK)
    return y
