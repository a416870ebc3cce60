"""Base models with the config.json of real hub checkpoints (tests/helpers/hub_configs.py: Llama 2 / 3.1 / 3.2,
Mistral v0.1 / Nemo, Qwen2.5 with YaRN, Qwen3, Phi-3-4k / Phi-3 "su" / Phi-4, Gemma 2, Gemma 3 text and Gemma 3's
multimodal config with its sparse text_config), shrunk, random weights: the engine's greedy tokens equal HF
transformers' (fp32, CPU) for prompts several sliding windows long and past the trained context
(`original_max_position_embeddings` 32), in one batch with chunked prefill. Each reference is clear of a tie.
The config fields themselves against transformers' reading: test_hub_config_fields.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

from core import LLM, SamplingParams  # noqa: E402
from core.config import ModelConfig  # noqa: E402
from core.scheduling.context_limit import supported_max_len  # noqa: E402
from family_parity import MIN_MARGIN  # noqa: E402
from hub_configs import HUB_CONFIGS, hub_model_dir, reference_dir  # noqa: E402
from lora_tree import greedy_with_margin  # noqa: E402
from testlib import PROMPTS, _hf_model, encode  # noqa: E402

MAX_TOKENS = 16
# 13 tokens (+16 fit the trained context of 32: longrope's short factors), 97 and 187 (past it, and many windows)
TEXTS = [PROMPTS[0], PROMPTS[4], PROMPTS[6]]


@pytest.mark.parametrize("name", list(HUB_CONFIGS))
def test_hub_config_matches_hf(name: str) -> None:
    path = hub_model_dir(name)
    ref_path = reference_dir(path)
    max_len = min(256, supported_max_len(ModelConfig.from_path(path)).num_tokens)
    prompts = [ids for ids in (encode(ref_path, t) for t in TEXTS) if len(ids) + MAX_TOKENS <= max_len]
    assert len(prompts) >= 2, "test setup: the prompts should fit the context"
    hf = _hf_model(str(ref_path))
    expected = []
    for ids in prompts:
        tokens, margin = greedy_with_margin(hf, ids, MAX_TOKENS)
        assert margin > MIN_MARGIN, f"test setup: {name} reference near a tie (gap {margin})"
        expected.append(tokens)
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=max_len, num_kv_blocks=96, block_size=8,
              max_num_batched_tokens=24)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for ids, out, ref in zip(prompts, outs, expected):
        assert list(out.token_ids) == ref, f"{name}, {len(ids)}-token prompt\n expected {ref}\n got {out.token_ids}"


def test_eos_list_of_config_json_without_generation_config(tmp_path: Path) -> None:
    """A checkpoint without generation_config.json (a hub config.json with its weights): transformers stops at
    config.json's eos_token_id list (Llama 3.1 names three), so the engine does too."""
    src = hub_model_dir("llama3.1")
    ids = encode(src, PROMPTS[4])
    full, _ = greedy_with_margin(_hf_model(str(src)), ids, MAX_TOKENS)
    stop = full[3]     # a token the model emits greedily, not the tokenizer's eos
    path = tmp_path / "model"
    shutil.copytree(src, path)
    (path / "generation_config.json").unlink()
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = [cfg["eos_token_id"], stop]
    (path / "config.json").write_text(json.dumps(cfg))
    expected, _ = greedy_with_margin(_hf_model(str(path)), ids, MAX_TOKENS)
    assert expected == full[:4], "test setup: transformers should stop at config.json's eos list"
    out = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64).generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    assert list(out.token_ids) == expected and out.finish_reason == "stop"


def test_dynamic_rope_past_max_position_embeddings_is_refused() -> None:
    """Past max_position_embeddings HF's dynamic NTK rescales rope per forward (the cache keeps the old
    rotations): a --max-model-len that long is a start-up error naming the limit, never served."""
    with pytest.raises(ValueError, match="rope_scaling dynamic is served up to max_position_embeddings=256"):
        LLM(str(hub_model_dir("llama2-dynamic")), dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=16)
