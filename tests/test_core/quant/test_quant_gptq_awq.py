"""GPTQ (4/8 bits, sym and not, desc_act with g_idx, the v1 zero-point offset) and AWQ (GEMM, interleaved
nibbles) checkpoints built from their documented layouts (tests/helpers/quant_layouts.py): greedy base and LoRA rows in
one batch equal HF transformers / PEFT on the float weights they stand for (fp32, CPU)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

from core import LLM, SamplingParams  # noqa: E402
from core.quant.linear import QuantLinear  # noqa: E402
from quant_layouts import LAYOUTS, dequantize_file, layout_model  # noqa: E402
from quant_models import check_mixed_batch, save_all7_adapter  # noqa: E402
from testlib import PROMPTS, encode  # noqa: E402

TEXTS = [PROMPTS[0], PROMPTS[2], PROMPTS[5]]
GREEDY_12 = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_base_and_lora_match_references(name: str) -> None:
    path, ref = layout_model(name)
    method = LAYOUTS[name][1]
    adapter = save_all7_adapter(ref)
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=128, lora_modules={"tenant": str(adapter)},
              quantization=method)
    model = llm.engine.model
    down = model.model.layers[0].mlp.down_proj.base
    assert isinstance(down, QuantLinear)
    # the loader's weight equals the file decoded by the test's own shifts and masks, and the builder's floats
    from safetensors.torch import load_file
    ref_w = load_file(str(ref / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(dequantize_file(path, "model.layers.0.mlp.down_proj"), ref_w)
    assert torch.equal(down.dequantize(), ref_w)
    check_mixed_batch(llm, ref, adapter, [encode(path, t) for t in TEXTS])


def test_hot_load_and_lora_dir_on_awq_base(tmp_path) -> None:
    """Adapters that arrive after start-up (admin hot load, a `--lora-dir` folder) on a quantized base."""
    import shutil

    path, ref = layout_model("awq_w4_g32")
    adapter = save_all7_adapter(ref)
    shutil.copytree(adapter, tmp_path / "acme" / "support")
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=128, lora_dirs=[str(tmp_path)])
    llm.engine.load_lora("tenant", str(adapter))
    expected = check_mixed_batch(llm, ref, adapter, [encode(path, TEXTS[0])])
    out = llm.generate([{"prompt_token_ids": encode(path, TEXTS[0])}], GREEDY_12, lora=["acme/support"])
    assert out[0].token_ids == expected[1]
