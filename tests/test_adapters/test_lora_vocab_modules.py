"""LoRA on the embeddings and the LM head as PEFT puts it (`embed_tokens` / `lm_head` in target_modules, not
modules_to_save): greedy fp32 token for token against `PeftModel`, beside DoRA on the LM head and plain LoRA rows
and base rows in every batch, with chunked prefill, preemption, the prefix cache and prompt log-probs (the LM head
on prompt rows). Families: Llama (untied), Qwen2 (tied embeddings), Gemma 3 (tied, embeddings scaled by
sqrt(hidden) after the LoRA as in PEFT). The precondition: each adapter's tokens differ without its vocabulary
modules."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning",
                                        "ignore:.*save_embedding_layers.*:UserWarning")

from core import LLM, SamplingParams  # noqa: E402
from dora_fixtures import save_dora_adapter, save_lora_adapter, without_modules  # noqa: E402
from family_models import GEMMA_SPECS  # noqa: E402
from family_parity import MAX_TOKENS, check_family  # noqa: E402
from lora_tree import peft_greedy_path, prompt_logprobs_as_reference, write_adapter  # noqa: E402
from testlib import PROMPTS, SPECS, _hf_model, encode  # noqa: E402
from tiny_models import tiny_model_dir  # noqa: E402

FAMILIES = {"llama": SPECS["llama_gqa"], "qwen2": SPECS["qwen2_tied"], "gemma3_text": GEMMA_SPECS["gemma3_text"]}
SEEDS = {"gemma3_text": 61}
TEXTS = [PROMPTS[2], PROMPTS[7]]
VOCAB = ("embed_tokens", "lm_head")


def vocab_adapters(name: str, path: Path, out: Path) -> tuple[dict[str, Path], dict[str, Path]]:
    """(served: LoRA on embed_tokens + lm_head + q_proj, plain LoRA on q/v, DoRA on lm_head + v_proj + down_proj;
    the same adapters without their vocabulary modules)."""
    seed = SEEDS.get(name, 51)
    vocab = save_lora_adapter(path, out / "vocab", ["embed_tokens", "lm_head", "q_proj"], 8, seed)
    plain = write_adapter(out / "plain", path, 4, ["q_proj", "v_proj"], seed=seed + 1, b_mult=1.5)
    head_dora = save_dora_adapter(path, out / "head-dora", ["lm_head", "v_proj", "down_proj"], 8, seed + 2,
                                  jitter=0.1, b_mult=0.3)
    twins = {n: without_modules(out / n, out / f"{n}-twin", VOCAB) for n in ("vocab", "head-dora")}
    return {"vocab": vocab, "plain": plain, "head-dora": head_dora}, twins


@pytest.mark.parametrize("family", list(FAMILIES))
def test_vocab_lora_matches_peft(family: str, tmp_path: Path) -> None:
    path = tiny_model_dir(FAMILIES[family])
    adapters, twins = vocab_adapters(family, path, tmp_path)
    ids = [encode(path, t) for t in TEXTS]
    for name, twin in twins.items():
        assert [peft_greedy_path(path, adapters[name], p, MAX_TOKENS)[0] for p in ids] != \
            [peft_greedy_path(path, twin, p, MAX_TOKENS)[0] for p in ids], f"test setup: {name}'s vocab LoRA is moot"
    check_family(path, adapters, TEXTS, prefix=True)


def test_lm_head_lora_in_prompt_logprobs(tmp_path: Path) -> None:
    """The LM head's LoRA on prompt rows (the prompt log-prob pass) equals PEFT's log-softmax."""
    from peft import PeftModel

    from lora_fixtures import _fresh_base

    path = tiny_model_dir(FAMILIES["llama"])
    adapter = save_lora_adapter(path, tmp_path / "vocab", ["embed_tokens", "lm_head"], 8, 51)
    ids = encode(path, TEXTS[0])
    llm = LLM(str(path), lora_modules={"v": str(adapter)}, dtype="float32", device="cpu", max_loras=2,
              max_lora_rank=8)
    out = llm.generate([{"prompt_token_ids": ids}] * 2, SamplingParams(max_tokens=1, temperature=0.0,
                                                                      prompt_logprobs=0), lora=["v", None])
    peft = PeftModel.from_pretrained(_fresh_base(str(path)), str(adapter)).eval()
    for model, got in ((peft, out[0]), (_hf_model(str(path)), out[1])):
        prompt_logprobs_as_reference(model, ids, got)


def test_a_vocabulary_adapter_does_not_depend_on_torchs_global_generator(tmp_path: Path) -> None:
    """The test adapters are a function of their seed: PEFT creates `lora_embedding_A/B` from torch's global
    generator, which the tests that ran before in the same process had moved (this file's reference once fell
    under its tie margin in one xdist order)."""
    import torch
    from safetensors.torch import load_file

    path = tiny_model_dir(FAMILIES["llama"])
    weights = []
    for state in (1, 2):
        torch.manual_seed(state)
        out = save_lora_adapter(path, tmp_path / f"v{state}", ["embed_tokens", "lm_head", "q_proj"], 8, 51)
        weights.append(load_file(str(out / "adapter_model.safetensors")))
    assert any("lora_embedding" in k for k in weights[0])
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
