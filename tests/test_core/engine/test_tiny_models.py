"""Tests for tiny_models: offline tokenizer + random Llama-family checkpoints."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tiny_models import (
    BOS,
    CHAT_MARKERS,
    EOS,
    LLAMA3_ROPE_SCALING,
    TinyModelSpec,
    build_tokenizer,
    special_token_ids,
    tiny_model_dir,
)

transformers = pytest.importorskip("transformers")

SPECS: dict[str, TinyModelSpec] = {
    "llama": TinyModelSpec(arch="llama", rope_scaling=LLAMA3_ROPE_SCALING),
    "mistral": TinyModelSpec(arch="mistral", seed=1),
    "qwen2": TinyModelSpec(arch="qwen2", tie_word_embeddings=True, seed=2),
}


@pytest.fixture(scope="module", autouse=True)
def _single_thread() -> Iterator[None]:
    """Tiny models are overhead-bound; 1 thread is much faster when the cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


def test_tokenizer_bos_roundtrip_and_specials(tmp_path: Path) -> None:
    d = build_tokenizer(tmp_path / "tok")
    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert len(tok) == 512
    text = "def add(a, b):\n    return a + b  # sum\n\tx = {'k': [1, 2.5]}\n"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == EOS
    assert tok.pad_token_id is not None
    sid = special_token_ids(d)
    assert sid[BOS] == tok.bos_token_id and all(m in sid for m in CHAT_MARKERS)
    assert tok("<|user|>hi<|end|>", add_special_tokens=False).input_ids[0] == sid["<|user|>"]


def test_tokenizer_cache_copies_identical_files(tmp_path: Path) -> None:
    a = build_tokenizer(tmp_path / "a")
    b = build_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_chat_template(tmp_path: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tok"))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|system|>\nbe brief<|end|>\n<|user|>\nhello<|end|>\n<|assistant|>\n"
    no_gen = tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    assert not no_gen.endswith("<|assistant|>\n")
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_model_loads_and_has_margin(arch: str, root: Path) -> None:
    spec = SPECS[arch]
    d = tiny_model_dir(spec, root)
    assert tiny_model_dir(spec, root) == d  # cached
    cfg = json.loads((d / "config.json").read_text())
    gen_cfg = json.loads((d / "generation_config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert gen_cfg["eos_token_id"] == tok.eos_token_id and cfg["bos_token_id"] == tok.bos_token_id
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert model.config.model_type == arch
    assert model.config.tie_word_embeddings == spec.tie_word_embeddings
    if arch == "qwen2":
        bias = model.model.layers[0].self_attn.q_proj.bias
        assert bias is not None and bias.abs().min() > 0
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    gen = torch.Generator().manual_seed(7)
    gaps: list[float] = []
    outputs: set[tuple[int, ...]] = set()
    for _ in range(8):
        n = int(torch.randint(3, 16, (1,), generator=gen))
        body = torch.randint(len(special_token_ids(d)), model.config.vocab_size, (1, n), generator=gen)
        ids = torch.cat([torch.tensor([[tok.bos_token_id]]), body], dim=1)
        out = model.generate(
            ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
        )
        gaps += [float(v[0] - v[1]) for v in (lg[0].topk(2).values for lg in out.logits)]
        outputs.add(tuple(out.sequences[0, ids.shape[1]:].tolist()))
    g = torch.tensor(gaps)
    assert float(g.median()) > 0.5
    assert float((g < 1e-3).float().mean()) < 0.02
    assert len(outputs) >= 6  # outputs vary across prompts


def test_legacy_config_style_matches_v5(root: Path) -> None:
    base = TinyModelSpec(arch="llama", rope_scaling=LLAMA3_ROPE_SCALING, seed=3)
    legacy = TinyModelSpec(arch="llama", rope_scaling=LLAMA3_ROPE_SCALING, seed=3, config_style="legacy")
    d5, dl = tiny_model_dir(base, root), tiny_model_dir(legacy, root)
    cfg = json.loads((dl / "config.json").read_text())
    assert "rope_parameters" not in cfg and cfg["rope_scaling"]["rope_type"] == "llama3"
    x = (torch.arange(300) * 7 % 500 + 7).unsqueeze(0)
    with torch.no_grad():
        a = transformers.AutoModelForCausalLM.from_pretrained(d5).eval()(x).logits
        b = transformers.AutoModelForCausalLM.from_pretrained(dl).eval()(x).logits
    torch.testing.assert_close(a, b)


def test_spec_validation() -> None:
    with pytest.raises(ValueError):
        TinyModelSpec(arch="gpt2")
    with pytest.raises(ValueError):
        TinyModelSpec(num_heads=3)
    spec = TinyModelSpec(rope_scaling=dict(LLAMA3_ROPE_SCALING))
    assert hash(spec) == hash(TinyModelSpec(rope_scaling=dict(LLAMA3_ROPE_SCALING)))
    assert spec.rope_scaling_dict == LLAMA3_ROPE_SCALING
