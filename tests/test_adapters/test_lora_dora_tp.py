"""DoRA and the vocabulary modules' LoRA at tensor_parallel_size 2 (gloo, two processes), equal to `PeftModel`
greedy token for token: Qwen3 (biases on q/k/v and o: o's is row-parallel, added once after the all-reduce, and
DoRA's shift with it), with chunked prefill, preemption and a warm prefix cache. A column-parallel linear's DoRA
magnitudes are sharded with its rows; a row-parallel one's rows' norms are all-reduced once per slot write."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning",
                                        "ignore:.*save_embedding_layers.*:UserWarning")

from adapters.errors import AdapterError  # noqa: E402
from dora_fixtures import QWEN3_BIASED as QWEN3, save_dora_adapter, save_lora_adapter  # noqa: E402
from family_parity import check_family  # noqa: E402
from lora_fixtures import ALL7  # noqa: E402
from testlib import PROMPTS  # noqa: E402
from tiny_models import tiny_model_dir  # noqa: E402


def test_dora_and_vocab_lora_tp2_match_peft(tmp_path: Path) -> None:
    path = tiny_model_dir(QWEN3)
    adapters = {"dora-all": save_dora_adapter(path, tmp_path / "dora-all", ALL7, rank=8, seed=31),
                "vocab": save_lora_adapter(path, tmp_path / "vocab", ["embed_tokens", "lm_head", "q_proj"], 8, 51),
                "dora-mlp": save_dora_adapter(path, tmp_path / "dora-mlp", ["gate_proj", "up_proj", "down_proj",
                                                                             "o_proj"], rank=16, seed=33)}
    llm = check_family(path, adapters, [PROMPTS[2], PROMPTS[7]], prefix=True,
                       tensor_parallel_size=2)
    assert llm.engine.lora_pool.num_dora_computes >= 2


def test_lm_head_dora_is_refused_at_tp2(tmp_path: Path) -> None:
    """DoRA on the LM head (vocabulary rows sharded over the ranks) is a clear 400 at load (the registry of a
    tensor-parallel engine: core/engine/setup.py), without the path; the same adapter loads at one rank."""
    from adapters.layers.dims import BaseModelDims
    from adapters.registry.registry import AdapterRegistry
    from core.config import ModelConfig
    from core.distributed.lora import tp_adapter_loader

    path = tiny_model_dir(QWEN3)
    head = save_dora_adapter(path, tmp_path / "head", ["lm_head", "q_proj"], rank=4, seed=3)
    dims = BaseModelDims.from_model_config(ModelConfig.from_path(path))
    registry = AdapterRegistry(dims, 8, 2, loader=tp_adapter_loader)
    try:
        with pytest.raises(AdapterError) as info:
            registry.load("head", str(head))
        err = info.value
        assert err.status == 400 and err.code == "unsupported_adapter_feature" and "LM head" in err.message
        assert str(tmp_path) not in err.message
    finally:
        registry.shutdown()
    one_rank = AdapterRegistry(dims, 8, 2)
    try:
        assert one_rank.load("head", str(head)).name == "head"
    finally:
        one_rank.shutdown()
