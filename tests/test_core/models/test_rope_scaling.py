"""YaRN rope scaling (Qwen2.5 / Qwen3's long-context setting) on a tiny Qwen3: NTK-by-parts frequencies and
the attention factor (mscale) that scales cos and sin, as HF transformers computes them. The engine equals
HF / PEFT greedy (check_family); each part switched off in HF gives other tokens; a rope type we do not
implement is a clear start-up error. Longrope: tests/test_core/models/test_family_phi3.py."""
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
from family_parity import MAX_TOKENS, check_family, greedy_with_margin  # noqa: E402
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
    adapter = write_adapter(tmp_path / "all7", path, 8, ALL7, seed=45, b_mult=0.7)
    check_family(path, {"yarn-all7": adapter}, TEXTS, prefix=True)


@pytest.mark.parametrize("part", ["attention_factor", "frequencies"])
def test_each_yarn_part_changes_the_reference(path: Path, part: str) -> None:
    ids = [encode(path, t) for t in TEXTS]
    full = [greedy_with_margin(_hf_model(str(path)), p, MAX_TOKENS)[0] for p in ids]
    model = copy.deepcopy(_hf_model(str(path)))
    rotary = model.model.rotary_emb
    assert rotary.attention_scaling > 1.0
    if part == "attention_factor":
        rotary.attention_scaling = 1.0
    else:  # plain rope frequencies, the attention factor kept
        rotary.inv_freq.copy_(1.0 / (SPEC.rope_theta ** (torch.arange(0, 32, 2).float() / 32)))
    assert any(greedy_with_margin(model, p, MAX_TOKENS)[0] != ref for p, ref in zip(ids, full))


def test_unimplemented_rope_type_is_a_start_up_error(path: Path, tmp_path: Path) -> None:
    shutil.copytree(path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported rope scaling type 'dynamic'"):
        LLM(str(tmp_path / "m"), dtype="float32", device="cpu", num_kv_blocks=16)


@pytest.mark.parametrize("long", [False, True])
def test_partial_longrope_rotary_triton_matches_torch(long: bool) -> None:
    """Phi-4-mini's shape of rope (12 of 16 channels, longrope's stacked tables, a row offset): the Triton
    rotary kernel (interpreted on the CPU) equals the torch path; the passed-through channels are untouched."""
    from core.models.rope import PartialRotaryEmbedding
    from test_fused_ops import close, run

    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 16,
               "short_factor": [1.0 + 0.2 * i for i in range(6)], "long_factor": [3.0 + 2.0 * i for i in range(6)]}
    rope = PartialRotaryEmbedding(12, 64, 10000.0, scaling, 64)
    assert rope.cos.shape == (128, 12)                                   # [2 * P, rotary_dim]
    g = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 64, (5,), generator=g) + (64 if long else 0)
    qkv = torch.randn(5, (4 + 2 * 2) * 16, generator=g)                  # [T, (H + 2 Hkv) * D]

    def apply(qkv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = qkv.split([64, 32, 32], dim=-1)
        return rope.to(qkv.device)(positions, q.view(5, 4, 16), k.view(5, 2, 16))   # [T, H, D], [T, Hkv, D]

    ref_q, ref_k = run("torch", apply, qkv, positions)
    assert torch.equal(ref_q[..., 12:], qkv[:, :64].view(5, 4, 16)[..., 12:])
    for got, ref in zip(run("triton", apply, qkv, positions), (ref_q, ref_k)):
        close(got, ref, torch.float32)
