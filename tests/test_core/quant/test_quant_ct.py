"""compressed-tensors `pack-quantized` checkpoints (written by the real library) served with LoRA on top.

Greedy outputs equal HF transformers token for token (fp32, CPU): on the checkpoint itself where transformers
loads it (symmetric schemes), and always on compressed-tensors' own decompression of the saved files; LoRA
rows (PEFT, all seven projections) equal PEFT on that reference, in one batch with base rows.
"""
from __future__ import annotations

import pytest

pytest.importorskip("compressed_tensors")
pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

from core import LLM  # noqa: E402
from core.quant.linear import QuantLinear  # noqa: E402
from quant_models import check_mixed_batch, ct_model, ct_reference_dir, save_all7_adapter  # noqa: E402
from testlib import PROMPTS, encode, hf_greedy  # noqa: E402

MAX_TOKENS = 12
TEXTS = [PROMPTS[0], PROMPTS[2], PROMPTS[5]]
HF_LOADS = ("w4a16_sym_g32", "w8a16_ch")   # transformers 5 + compressed-tensors 0.20 load these directly
                                           # (asymmetric: its packed zero points fail a shape check)


def _llm(name: str, **kw) -> LLM:
    return LLM(str(ct_model(name)), dtype="float32", device="cpu", num_kv_blocks=128, **kw)


@pytest.mark.parametrize("name", ["w4a16_sym_g32", "w4a16_asym_g32", "w4a16_asym_ch", "w8a16_ch",
                                  "w8a16_asym_g32", "w4a16_sym_g32_qwen2", "w4a16_asym_g32_qwen3",
                                  "w8a16_ch_gemma2"])
def test_base_and_lora_match_references(name: str) -> None:
    path, ref = ct_model(name), ct_reference_dir(name)
    adapter = save_all7_adapter(ref)
    llm = _llm(name, lora_modules={"tenant": str(adapter)})
    layer = llm.engine.model.model.layers[0]
    for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(mod.base, QuantLinear)                 # LoRA wraps the quantized linear
    assert not isinstance(llm.engine.model.lm_head, QuantLinear)  # `ignore: [lm_head]`
    prompts = [encode(path, t) for t in TEXTS]
    expected = check_mixed_batch(llm, ref, adapter, prompts, MAX_TOKENS)
    if name in HF_LOADS:
        for ids, tokens in zip(prompts, expected):
            assert hf_greedy(path, ids, MAX_TOKENS) == tokens   # transformers decompressing the checkpoint


def test_quantized_lm_head_is_refused_by_name(tmp_path) -> None:
    from core.quant.config import UnsupportedQuantization
    from quant_models import CT_SCHEMES, write_ct_checkpoint
    from testlib import model_dir

    wargs = CT_SCHEMES["w4a16_sym_g32"][1]
    path = write_ct_checkpoint(model_dir("llama_gqa"), tmp_path / "m", wargs, "pack-quantized", ignore=())
    with pytest.raises(UnsupportedQuantization, match="compressed-tensors checkpoint quantizes lm_head"):
        LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=16)
