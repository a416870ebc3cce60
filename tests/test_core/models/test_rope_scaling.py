"""YaRN rope scaling (Qwen2.5 / Qwen3's long-context setting) on a tiny Qwen3: NTK-by-parts frequencies and
the attention factor (mscale) that scales cos and sin, as HF transformers computes them. The engine equals
HF / PEFT greedy (check_family, three adapters in slots 0-2), whose precondition is that each part switched
off in HF gives other tokens; a rope type we do not implement is a clear start-up error. Longrope: tests/test_core/models/test_family_phi3.py."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from core import LLM  # noqa: E402
from family_parity import MAX_TOKENS, check_family, family_adapters, greedy_with_margin  # noqa: E402
from lora_fixtures import ALL7  # noqa: E402
from lora_tree import write_adapter  # noqa: E402
from testlib import PROMPTS, _hf_model, encode  # noqa: E402
from tiny_models import TinyModelSpec, tiny_model_dir  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}
SPEC = TinyModelSpec(arch="qwen3", num_heads=4, num_kv_heads=2, head_dim=32, rope_scaling=YARN,
                     max_position_embeddings=256, seed=9)
TEXTS = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]


@pytest.fixture(scope="module")
def path() -> Path:
    return tiny_model_dir(SPEC)


def test_yarn_matches_hf_and_peft(path: Path, tmp_path: Path) -> None:
    for part in ("attention_factor", "frequencies"):   # the precondition: without each part HF gives other tokens
        assert_yarn_part_changes_the_reference(path, part)
    adapter = write_adapter(tmp_path / "all7", path, 8, ALL7, seed=45, b_mult=0.7)
    check_family(path, family_adapters(path, tmp_path, "yarn", adapter, seeds=(54, 52)), TEXTS, prefix=True)


def assert_yarn_part_changes_the_reference(path: Path, part: str) -> None:
    ids = [encode(path, t) for t in TEXTS]
    full = [greedy_with_margin(_hf_model(str(path)), p, MAX_TOKENS)[0] for p in ids]
    model = copy.deepcopy(_hf_model(str(path)))
    rotary = model.model.rotary_emb
    assert rotary.attention_scaling > 1.0
    if part == "attention_factor":
        rotary.attention_scaling = 1.0
    else:  # plain rope frequencies, the attention factor kept
        rotary.inv_freq.copy_(1.0 / (SPEC.rope_theta ** (torch.arange(0, 32, 2).float() / 32)))
    assert any(greedy_with_margin(model, p, MAX_TOKENS)[0] != ref for p, ref in zip(ids, full)), \
        f"test setup: switching {part} off in HF does not change its tokens"


def test_unimplemented_rope_type_is_a_start_up_error(path: Path, tmp_path: Path) -> None:
    shutil.copytree(path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "proportional", "factor": 2.0, "rope_theta": 10000.0}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported rope scaling type 'proportional'"):
        LLM(str(tmp_path / "m"), dtype="float32", device="cpu", num_kv_blocks=16)
