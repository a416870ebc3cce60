"""A linear layer whose weight stays quantized in device memory; y = x @ dequant(W)^T (+ bias).

Integer codes (`kind` "int"): 4-bit codes packed 8 to an int32 along the input (`qweight` [out, in / 8]),
8-bit codes as uint8 [out, in]; `scales` [out, groups] in the model dtype, `zeros` [out, groups] (uint8 for 4 bits, int16 for 8)
(the code of 0.0: 2**(bits-1) when symmetric), optional `g_idx` int32 [in] (GPTQ act-order: the group of
every input column; without it column i belongs to group i // group_size).
FP8 (`kind` "float"): `qweight` float8_e4m3fn [out, in], `scales` [out, 1] (per channel; a per-tensor scale
is broadcast).

Act-order: `finalize` sorts the input columns by group once (act_order.py): the codes are stored in that order,
`act_perm` [in] keeps it (x's columns are permuted per call on the kernel path), `g_idx` becomes None.
Paths: on CUDA, integer codes go through the Triton GEMM that dequantizes inside the kernel (triton_gemm.py),
FP8 through `torch._scaled_mm` where the GPU has FP8 tensor cores (fp8_mm.py: activations quantized per token in
one Triton launch, fp8_quant.py).
The torch path (every other case) dequantizes per forward and runs one matmul (bit-identical to an HF model holding the
dequantized weights). On the CPU, symmetric per-channel int8 with bf16/fp16 activations uses torch's weight-only
int8 kernel (`aten._weight_int8pack_mm`, which never materializes the float weight): measured about as fast as
a bf16 matmul and ~4x faster than dequantize-then-matmul; with fp32 activations that kernel is slower than the
generic path here, so fp32 keeps it (benchmarks/results/quant_cpu_decode.md).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from core.quant import fp8_mm, triton_gemm
from core.quant.act_order import group_order, inverse
from core.quant.packing import pack_rows, unpack_rows


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, kind: str, num_bits: int, num_groups: int,
                 bias: bool, dtype: torch.dtype, device: torch.device | str, has_g_idx: bool = False,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, act_quant: str | None = None) -> None:
        super().__init__()
        assert kind in ("int", "float") and num_bits in (4, 8), (kind, num_bits)
        self.in_features, self.out_features = in_features, out_features
        self.kind, self.num_bits, self.num_groups = kind, num_bits, num_groups
        self.reduce = reduce          # tensor parallel row-parallel linears: the all-reduce, before the bias
        assert act_quant in (None, "static", "dynamic-token", "dynamic-tensor") and (act_quant is None or kind == "float")
        self.act_quant = act_quant    # FP8 activations: quantize-dequantize the input (compressed-tensors' arithmetic)
        if kind == "float":
            qweight = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        elif num_bits == 4:
            qweight = torch.empty(out_features, -(-in_features // 8), dtype=torch.int32, device=device)
        else:
            qweight = torch.empty(out_features, in_features, dtype=torch.uint8, device=device)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", torch.empty(out_features, num_groups, dtype=dtype, device=device))
        zdtype = torch.uint8 if num_bits == 4 else torch.int16         # 8 bits: GPTQ v1's zero + 1 may be 256
        zeros = torch.empty(out_features, num_groups, dtype=zdtype, device=device) if kind == "int" else None
        self.register_buffer("zeros", zeros)
        g_idx = torch.empty(in_features, dtype=torch.int32, device=device) if has_g_idx else None
        self.register_buffer("g_idx", g_idx)
        input_scale = torch.empty((), dtype=torch.float32, device=device) if act_quant == "static" else None
        self.register_buffer("input_scale", input_scale)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None
        self._int8_scales: torch.Tensor | None = None   # set by finalize: the CPU int8 kernel's path
        # set by finalize: act-order column order int32 [in] and its inverse (buffers: move with the module, never saved)
        self.register_buffer("act_perm", None, persistent=False)
        self.register_buffer("_act_inverse", None, persistent=False)
        # set by finalize: fp32 [1, out] for `_scaled_mm` on CUDA (a buffer: moves with the module, never saved)
        self.register_buffer("_fp8_col_scales", None, persistent=False)

    @property
    def group_size(self) -> int:
        return -(-self.in_features // self.num_groups)

    def finalize(self) -> None:
        """After the buffers are filled: pick the fastest exact path for this device."""
        if self.kind == "int" and self.g_idx is not None:
            self._fold_act_order()
        if self.kind == "int" and self.num_bits == 8 and self.num_groups == 1 and self.g_idx is None \
                and self.act_perm is None and not triton_gemm.use_triton(self.qweight) \
                and self.qweight.device.type == "cpu" and self.qweight.dtype == torch.uint8 \
                and bool((self.zeros == 128).all()):
            self.qweight = (self.qweight.to(torch.int16) - 128).to(torch.int8)       # [out, in], in place of
            self._int8_scales = self.scales[:, 0].contiguous()                        # the codes (same bytes)
        if self.kind == "float" and self.qweight.is_cuda:                             # no cast per forward
            self._fp8_col_scales = self.scales.float().reshape(1, -1).contiguous()    # [1, out]

    def _fold_act_order(self) -> None:
        """Stores the codes with their input columns sorted by group (g_idx then None), once at load."""
        perm = group_order(self.g_idx, self.num_groups, self.group_size)
        if perm is None:
            return                                                                    # keeps the torch path
        if not torch.equal(perm, torch.arange(self.in_features, device=perm.device)):
            codes = self.codes().index_select(1, perm)                                # [out, in], sorted columns
            self.qweight.copy_(pack_rows(codes, 4) if self.num_bits == 4 else codes)
            self.act_perm = perm.to(torch.int32)
            self._act_inverse = inverse(perm)
        self.g_idx = None

    def codes(self) -> torch.Tensor:
        """The integer codes [out, in] (uint8), in the stored column order (act-order: sorted by group)."""
        if self.num_bits == 4:
            return unpack_rows(self.qweight, 4, self.in_features)
        if self.qweight.dtype == torch.int8:                                          # the int8 kernel's copy
            return (self.qweight.to(torch.int16) + 128).to(torch.uint8)
        return self.qweight

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight [out, in] the quantized one stands for (in the checkpoint's column order)."""
        dtype = dtype or self.scales.dtype
        if self.kind == "float":
            return self.qweight.to(dtype) * self.scales.to(dtype)
        if self.g_idx is None and self.in_features % self.num_groups == 0:            # broadcast per group
            gs = self.in_features // self.num_groups
            codes = self.codes().view(self.out_features, self.num_groups, gs)         # [out, groups, gs]
            w = (codes.to(dtype) - self.zeros.unsqueeze(-1).to(dtype)) * self.scales.unsqueeze(-1).to(dtype)
            w = w.view(self.out_features, self.in_features)                           # [out, in]
            return w if self._act_inverse is None else w.index_select(1, self._act_inverse)
        if self.g_idx is not None:
            idx = self.g_idx.long()
            scales, zeros = self.scales[:, idx], self.zeros[:, idx]                   # [out, in]
        else:
            gs = self.group_size
            scales = self.scales.repeat_interleave(gs, dim=1)[:, :self.in_features]  # [out, in]
            zeros = self.zeros.repeat_interleave(gs, dim=1)[:, :self.in_features]
        w = (self.codes().to(torch.int16) - zeros.to(torch.int16)).to(dtype) * scales.to(dtype)   # [out, in]
        return w if self._act_inverse is None else w.index_select(1, self._act_inverse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._int8_scales is not None and x.dtype in (torch.bfloat16, torch.float16):
            x2 = x.reshape(-1, self.in_features)                                      # [T, in]
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self._int8_scales.to(x.dtype))
            y = y.view(*x.shape[:-1], self.out_features)                              # [..., out]
        elif self.kind == "float" and x.is_cuda and fp8_mm.supported(x) and self.out_features % 16 == 0:
            x2 = x.reshape(-1, self.in_features)                                      # [T, in]
            sw = self.scales if self._fp8_col_scales is None else self._fp8_col_scales
            y = fp8_mm.scaled_mm(x2, self.qweight, sw, self.input_scale)
            y = y.view(*x.shape[:-1], self.out_features)                              # [..., out]
        elif (plan := self.kernel_plan(x)) is not None:
            x2 = x.reshape(-1, self.in_features)                                      # [T, in]
            y = triton_gemm.wq_matmul(x2, self.qweight, self.scales, self.zeros, self.num_bits, self.in_features,
                                      self.out_features, plan, self.act_perm)
            y = y.view(*x.shape[:-1], self.out_features)                              # [..., out]
        else:
            y = F.linear(x if self.act_quant is None else self._fake_quant_fp8(x), self.dequantize(x.dtype))
        if self.reduce is not None:
            y = self.reduce(y)
        return y if self.bias is None else y + self.bias

    def kernel_plan(self, x: torch.Tensor) -> triton_gemm.Plan | None:
        """The dequantizing GEMM's launch for x, or None (torch path): FP8, an unfolded g_idx, a shape it cannot tile."""
        if self.kind != "int" or self.g_idx is not None or not triton_gemm.use_triton(x):
            return None
        return triton_gemm.plan_for(x.numel() // self.in_features, self.qweight, self.num_groups, self.num_bits,
                                    self.in_features, self.out_features)

    def _fake_quant_fp8(self, x: torch.Tensor) -> torch.Tensor:
        """x rounded through float8_e4m3fn with a static, per-token or per-tensor scale (amax / 448)."""
        fmax = torch.finfo(torch.float8_e4m3fn).max
        if self.act_quant == "static":
            scale = self.input_scale.to(x.dtype)
        else:
            amax = x.abs().amax(dim=-1, keepdim=True) if self.act_quant == "dynamic-token" else x.abs().amax()
            scale = amax / fmax                                                        # [T, 1] or []
            scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
        return (x / scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn).to(x.dtype) * scale

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, {self.kind}{self.num_bits}, "
                f"groups={self.num_groups}, g_idx={self.g_idx is not None}, bias={self.bias is not None}")
