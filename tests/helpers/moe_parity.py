"""The three adapters of each tiny MoE family and the reference each is checked against
(tests/test_core/models/test_moe_*.py).

    adapters = moe_family_adapters("qwen2_moe", str(tmp))
    check_family(moe_dir("qwen2_moe"), adapters, texts, prefix=True, reference_fn=moe_reference)

- `params`: PEFT `target_parameters` on experts.gate_up_proj and experts.down_proj, plus q/v LoRA (PEFT reference);
- `per-expert`: the transformers-4 layout (experts.N.w1/w3/w2, or gate/up/down_proj; Qwen2-MoE's shared expert and
  Qwen3-MoE's dense layer under the same names), against the HF base with the LoRA folded into its weights
  (peft's own conversion of this layout drops the shared-expert and dense-layer modules);
- `down-first`: the experts and the router only, `target_parameters` listed in another order (PEFT reference).
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from family_parity import MAX_TOKENS, MIN_MARGIN, reference
from lora_tree import greedy_with_margin
from moe_adapters import expert_params_adapter, merged_model, per_expert_adapter
from moe_models import moe_dir
from testlib import PROMPTS

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
TEXTS = [PROMPTS[2], PROMPTS[4]]          # the prompts every MoE parity test runs


@lru_cache(maxsize=None)
def moe_family_adapters(family: str, root: str) -> dict[str, Path]:
    path, out = moe_dir(family), Path(root) / family
    return {
        f"{family}-params": expert_params_adapter(path, out / "params", ["experts.gate_up_proj", "experts.down_proj"],
                                                  ["q_proj", "v_proj"], 4, 8, 1.0, 61),
        f"{family}-per-expert": per_expert_adapter(path, out / "per-expert", family, 4, 8, 1.0, 62),
        f"{family}-down-first": expert_params_adapter(path, out / "down-first",
                                                      ["experts.down_proj", "mlp.gate.weight", "experts.gate_up_proj"],
                                                      [], 8, 8, 1.0, 63),
    }


@lru_cache(maxsize=None)
def _reference(path: Path, adapter: Path | None, ids: tuple[int, ...]) -> tuple[int, ...]:
    if adapter is None or "per-expert" not in adapter.name:
        return tuple(reference(path, adapter, list(ids)))
    tokens, margin = greedy_with_margin(merged_model(path, adapter), list(ids), MAX_TOKENS)
    assert margin > MIN_MARGIN, f"test setup: folded reference near a tie ({adapter}, gap {margin})"
    return tuple(tokens)


def moe_reference(path: Path, adapter: Path | None, ids: list[int]) -> list[int]:
    return list(_reference(path, adapter, tuple(ids)))
