"""core/quant pieces on their own: packing against compressed-tensors' packer and a hand-built AWQ word,
QuantLinear against a dequantization written here, detection errors, tensor-parallel group checks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.quant.config import UnsupportedQuantization, detect_quantization
from core.quant.formats import Canonical
from core.quant.linear import QuantLinear
from core.quant.loader import _slice_cols
from core.quant.packing import AWQ_ORDER, pack_rows, unpack_cols, unpack_rows


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_matches_compressed_tensors_packer(bits: int) -> None:
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    gen = torch.Generator().manual_seed(bits)
    lo = -(1 << (bits - 1))
    q = torch.randint(lo, -lo, (6, 40), generator=gen, dtype=torch.int8)          # [out, in] signed codes
    packed = ct.pack_to_int32(q, bits)                                              # along the input
    assert torch.equal(unpack_rows(packed, bits, 40).to(torch.int16) + lo, q.to(torch.int16))
    packed0 = ct.pack_to_int32(q, bits, packed_dim=0)                              # zero points: along dim 0
    assert torch.equal(unpack_cols(packed0, bits, 6).to(torch.int16) + lo, q.to(torch.int16))
    assert torch.equal(pack_rows((q.to(torch.int16) - lo).to(torch.uint8), bits), packed)


def test_awq_word_by_hand() -> None:
    cols = torch.arange(8, dtype=torch.uint8).view(1, 8) + 3                       # column i holds i + 3
    word = sum(int(cols[0, AWQ_ORDER[k]]) << (4 * k) for k in range(8))            # nibble k: column ORDER[k]
    word = word - (1 << 32) if word >= 1 << 31 else word
    assert pack_rows(cols, 4, AWQ_ORDER).item() == word
    assert torch.equal(unpack_rows(torch.tensor([[word]], dtype=torch.int32), 4, 8, AWQ_ORDER), cols)
    assert not torch.equal(unpack_rows(torch.tensor([[word]], dtype=torch.int32), 4, 8), cols)


def _reference_dequant(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       g_idx: torch.Tensor) -> torch.Tensor:
    out = torch.empty(codes.shape)
    for i in range(codes.shape[1]):   # one input column at a time, its group from g_idx
        g = int(g_idx[i])
        out[:, i] = (codes[:, i].float() - zeros[:, g].float()) * scales[:, g]
    return out


@pytest.mark.parametrize("bits,act_order", [(4, False), (4, True), (8, False), (8, True)])
def test_quant_linear_matches_reference(bits: int, act_order: bool) -> None:
    gen = torch.Generator().manual_seed(bits + act_order)
    out_f, in_f, gs = 12, 64, 16
    codes = torch.randint(0, 1 << bits, (out_f, in_f), generator=gen).to(torch.uint8)
    scales = torch.rand(out_f, in_f // gs, generator=gen) + 0.1
    zeros = torch.randint(0, 1 << bits, (out_f, in_f // gs), generator=gen).to(torch.int16)
    g_idx = torch.arange(in_f) // gs
    if act_order:
        g_idx = g_idx[torch.randperm(in_f, generator=gen)]
    q = QuantLinear(in_f, out_f, "int", bits, in_f // gs, True, torch.float32, "cpu", has_g_idx=act_order)
    q.qweight.copy_(pack_rows(codes, 4) if bits == 4 else codes)
    q.scales.copy_(scales)
    q.zeros.copy_(zeros)
    if act_order:
        q.g_idx.copy_(g_idx)
    q.bias.copy_(torch.randn(out_f, generator=gen))
    w = _reference_dequant(codes, scales, zeros, g_idx)
    assert torch.equal(q.dequantize(), w)
    x = torch.randn(3, in_f, generator=gen)
    torch.testing.assert_close(q(x), x @ w.t() + q.bias, rtol=1e-5, atol=1e-5)


def test_int8_cpu_kernel_path() -> None:
    gen = torch.Generator().manual_seed(0)
    q = QuantLinear(64, 32, "int", 8, 1, False, torch.float32, "cpu")
    q.qweight.copy_(torch.randint(0, 256, (32, 64), generator=gen).to(torch.uint8))
    q.scales.copy_(torch.rand(32, 1, generator=gen) * 0.01)
    q.zeros.fill_(128)
    w = q.dequantize()
    q.finalize()
    assert q.qweight.dtype == torch.int8 and q._int8_scales is not None
    assert torch.equal(q.dequantize(), w)                     # the same codes, stored signed
    x = torch.randn(5, 64, generator=gen)
    torch.testing.assert_close(q(x), x @ w.t(), rtol=1e-5, atol=1e-6)            # fp32: the generic path
    q.scales.data = q.scales.data.bfloat16()
    q._int8_scales = q._int8_scales.bfloat16()
    y = q(x.bfloat16())                                                            # bf16: the int8 kernel
    torch.testing.assert_close(y.float(), x.bfloat16().float() @ q.dequantize(torch.float32).t(), rtol=2e-2, atol=2e-2)


def _cfg_dir(tmp_path: Path, quant: dict | None) -> Path:
    cfg = {"model_type": "llama"}
    if quant is not None:
        cfg["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _ct(weights: dict, fmt: str = "pack-quantized", act: dict | None = None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": act}}}


def test_detection(tmp_path: Path) -> None:
    w4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    s = detect_quantization(_cfg_dir(tmp_path, _ct(w4)), "compressed-tensors")
    assert (s.num_bits, s.group_size, s.symmetric, s.is_ignored("lm_head"), s.is_ignored("model.layers.0.mlp.up_proj")) \
        == (4, 128, True, True, False)
    with pytest.raises(UnsupportedQuantization, match="--quantization gptq but the checkpoint is compressed-tensors"):
        detect_quantization(tmp_path, "gptq")
    act8 = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
    with pytest.raises(UnsupportedQuantization, match="input_activations=int8"):
        detect_quantization(_cfg_dir(tmp_path, _ct(dict(w4, num_bits=8, strategy="channel"), act=act8)))
    with pytest.raises(UnsupportedQuantization, match="quantization method 'bitsandbytes'"):
        detect_quantization(_cfg_dir(tmp_path, {"quant_method": "bitsandbytes"}))
    with pytest.raises(UnsupportedQuantization, match="gptq with a quantized lm_head"):
        detect_quantization(_cfg_dir(tmp_path, {"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}))
    with pytest.raises(UnsupportedQuantization, match="gptq bits=3"):
        detect_quantization(_cfg_dir(tmp_path, {"quant_method": "gptq", "bits": 3, "group_size": 128}))
    awq = detect_quantization(_cfg_dir(tmp_path, {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                  "version": "gemm", "modules_to_not_convert": ["mlp.down"]}))
    assert awq.is_ignored("model.layers.3.mlp.down_proj") and not awq.is_ignored("model.layers.3.mlp.up_proj")
    with pytest.raises(UnsupportedQuantization, match="awq bits=4 version=gemv"):
        detect_quantization(_cfg_dir(tmp_path, {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}))
    assert detect_quantization(_cfg_dir(tmp_path, None)) is None
    assert detect_quantization(tmp_path, "fp8").fmt == "fp8-online"
    with pytest.raises(UnsupportedQuantization, match="no quantization_config"):
        detect_quantization(tmp_path, "awq")


def test_row_parallel_shard_must_line_up_with_groups() -> None:
    from core.quant.config import QuantScheme

    scheme = QuantScheme("gptq", "gptq", "int", 4, True, 32)
    c = Canonical(torch.zeros(4, 96, dtype=torch.uint8), torch.ones(4, 3), torch.zeros(4, 3, dtype=torch.int16), None)
    half = _slice_cols(c, (32, 32), scheme, "down_proj")
    assert half.codes.shape == (4, 32) and half.scales.shape == (4, 1)
    with pytest.raises(ValueError, match="does not line up with the quantization group size 32"):
        _slice_cols(c, (48, 48), scheme, "model.layers.0.mlp.down_proj")
    g_idx = torch.arange(96, dtype=torch.int32).flip(0) // 32                       # act-order: all groups kept
    kept = _slice_cols(Canonical(c.codes, c.scales, c.zeros, g_idx), (48, 48), scheme, "down_proj")
    assert kept.scales.shape == (4, 3) and torch.equal(kept.g_idx, g_idx[48:])


def test_llama3_8b_int4_memory_bounds() -> None:
    """Device bytes of our int4 g128 layout for the Llama-3-8B shape (meta device: shapes only)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from quant_memory import measure

    res = measure()
    assert res["int4_g128"]["linear"] <= 0.27 * res["bf16"]["linear"]
    assert res["int4_g128"]["total"] <= 0.36 * res["bf16"]["total"]


def test_cli_quantization_flag() -> None:
    from gateway.cli import build_parser, config_from_args

    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "/m", "--quantization", "gptq"])
    assert config_from_args(args, parser).engine.quantization.method == "gptq"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantization", "bitsandbytes"])
