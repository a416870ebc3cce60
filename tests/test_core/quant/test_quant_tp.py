"""Quantized bases under tensor parallelism (gloo, CPU, fp32, N=2): packed codes, scales, zero points and
g_idx sharded consistently; base rows and the rows of three adapters (three device slots) in one batch equal
the single-device references; a shard that does not fall on group boundaries is a start-up error naming the
module."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("compressed_tensors")
pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

from core import LLM  # noqa: E402
from quant_layouts import layout_model  # noqa: E402
from quant_models import check_mixed_batch, ct_model, ct_reference_dir, save_all7_adapter  # noqa: E402
from testlib import PROMPTS, encode  # noqa: E402

MAX_TOKENS = 10


@pytest.mark.parametrize("name", ["w4a16_asym_g32", "gptq_w4_g32_sym_act"])
def test_tp2_matches_references(name: str) -> None:
    path, ref = layout_model(name) if name.startswith("gptq") else (ct_model(name), ct_reference_dir(name))
    adapter = save_all7_adapter(ref)
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, tensor_parallel_size=2,
              lora_modules={"tenant": str(adapter)})
    try:
        check_mixed_batch(llm, ref, adapter, [encode(path, t) for t in (PROMPTS[0], PROMPTS[2])], MAX_TOKENS)
    finally:
        llm.shutdown()


def test_shard_off_group_boundary_is_a_startup_error() -> None:
    # o_proj has 64 input columns: 4 ranks hold 16 each, inside one group of 32
    with pytest.raises(Exception, match="does not line up with the quantization group size 32"):
        LLM(str(ct_model("w4a16_sym_g32")), dtype="float32", device="cpu", num_kv_blocks=16,
            tensor_parallel_size=4)
    # the failed start left no process group behind: the next tensor-parallel engine of this process can start
    assert not torch.distributed.is_initialized()
