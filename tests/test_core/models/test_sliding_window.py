"""Real sliding-window attention on Mistral (every layer, window 8) and Qwen3 (`layer_types`: one full and one
sliding layer): equal to HF / PEFT greedy with prompts several windows long, chunked prefill, preemption and
prefix-cache hits longer than the window (three adapters in slots 0-2); the context is max_position_embeddings, not the window."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from core.config import ModelConfig  # noqa: E402
from family_parity import check_family, family_adapters  # noqa: E402
from lora_fixtures import ALL7  # noqa: E402
from lora_tree import write_adapter  # noqa: E402
from testlib import PROMPTS  # noqa: E402
from tiny_models import TinyModelSpec, tiny_model_dir  # noqa: E402

SPECS = {
    "mistral": TinyModelSpec(arch="mistral", num_heads=8, num_kv_heads=2, sliding_window=8, seed=31),
    "qwen3": TinyModelSpec(arch="qwen3", num_heads=4, num_kv_heads=2, head_dim=32, sliding_window=8, seed=32,
                           extra_config={"max_window_layers": 1, "layer_types": ["full_attention",
                                                                                 "sliding_attention"]}),
}
WINDOWS = {"mistral": (8, 8), "qwen3": (None, 8)}
TEXTS = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]


@pytest.mark.parametrize("name", list(SPECS))
def test_sliding_window_matches_hf_and_peft(name: str, tmp_path: Path) -> None:
    path = tiny_model_dir(SPECS[name])
    assert ModelConfig.from_path(path).layer_windows == WINDOWS[name]
    adapter = write_adapter(tmp_path / "a", path, 8, ALL7, seed=49, b_mult=0.7)
    llm = check_family(path, family_adapters(path, tmp_path, name, adapter, seeds=(54, 51)), TEXTS, prefix=True)
    assert llm.engine.max_model_len == SPECS[name].max_position_embeddings
