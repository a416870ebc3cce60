"""core/models/tokenizer_load.py picks the same tokenizer as `AutoTokenizer.from_pretrained` (class, vocabulary, special
tokens, encodings, chat template) for every test model and the embedded demo model, without importing the
architecture's configuration module (the import that made it slow)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from core.config import DEMO_MODEL_DIR
from core.models.tokenizer_load import light_config, load_tokenizer
from testlib import SPECS, model_dir

TEXTS = ["def fibonacci(n):\n    return n", "  héllo\twörld  \n\n", "<s>x</s><|user|>", ""]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def _folders() -> list[Path]:
    return [model_dir(name) for name in SPECS if name != "llama_gqa_1layer"] + [Path(DEMO_MODEL_DIR)]


@pytest.mark.parametrize("folder", _folders(), ids=lambda p: p.name)
def test_same_tokenizer_as_auto_tokenizer(folder: Path) -> None:
    ref, ours = AutoTokenizer.from_pretrained(str(folder)), load_tokenizer(folder)
    assert light_config(folder) is not None                     # the light path was taken
    assert type(ours) is type(ref)
    assert ours.get_vocab() == ref.get_vocab() and len(ours) == len(ref)
    assert ours.special_tokens_map == ref.special_tokens_map and ours.all_special_ids == ref.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (ref.bos_token_id, ref.eos_token_id,
                                                                         ref.pad_token_id)
    for text in TEXTS:
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids
            assert ours.decode(ids) == ref.decode(ids)
    assert ours.chat_template == ref.chat_template
    if ref.chat_template:
        assert ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
            ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def _copy_model(src: Path, dst: Path) -> Path:
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("model_type, tokenizer_class, extra", [
    ("llama", "LlamaTokenizerFast", {}),
    ("llama", "LlamaTokenizerFast", {"model_name": "phi3"}),   # model_name steers the class choice too
    ("qwen2", "Qwen2TokenizerFast", {}),
    ("mistral", "LlamaTokenizerFast", {}),
    ("phi3", "LlamaTokenizer", {}),
    ("llama", "TokenizersBackend", {}),
])
def test_declared_classes_resolve_as_auto_tokenizer(tmp_path: Path, model_type: str, tokenizer_class: str,
                                                    extra: dict) -> None:
    folder = _copy_model(model_dir("llama_gqa"), tmp_path)
    config = {**json.loads((folder / "config.json").read_text()), "model_type": model_type, **extra}
    (folder / "config.json").write_text(json.dumps(config))
    tok_config = {**json.loads((folder / "tokenizer_config.json").read_text()), "tokenizer_class": tokenizer_class}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    ref, ours = AutoTokenizer.from_pretrained(str(folder)), load_tokenizer(folder)
    assert light_config(folder) is not None
    assert type(ours) is type(ref)
    assert (ours.padding_side, ours.model_max_length, ours.all_special_ids) == \
        (ref.padding_side, ref.model_max_length, ref.all_special_ids)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text)


def test_never_loads_the_config_through_auto_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """AutoConfig is what imports the architecture's configuration module (and with it transformers'
    modelling integrations): the light path must not call it."""
    from transformers import AutoConfig

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("AutoConfig.from_pretrained was called")

    monkeypatch.setattr(AutoConfig, "from_pretrained", refuse)
    for folder in _folders():
        assert load_tokenizer(folder).encode("x = 1") == AutoTokenizer.from_pretrained(
            str(folder), config=light_config(folder)).encode("x = 1")


@pytest.mark.parametrize("change", ["no_model_type", "auto_map", "not_json", "no_tokenizer_class", "tok_auto_map",
                                    "configuration_files"])
def test_unusual_configs_fall_back_to_auto_config(tmp_path: Path, change: str) -> None:
    src = model_dir("llama_gqa")
    _copy_model(src, tmp_path)
    data = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer_config.json").read_text())
    if change == "no_tokenizer_class":
        del tok["tokenizer_class"]
    elif change == "tok_auto_map":
        tok["auto_map"] = {"AutoTokenizer": [None, "custom.Tokenizer"]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok))
    if change == "no_model_type":
        del data["model_type"]
    elif change == "configuration_files":
        data["configuration_files"] = ["config.v2.json"]
    elif change == "auto_map":
        data["auto_map"] = {"AutoConfig": "custom.Config"}
    (tmp_path / "config.json").write_text("{" if change == "not_json" else json.dumps(data))
    assert light_config(tmp_path) is None
    if change == "no_tokenizer_class":   # the fallback is transformers' own resolution: same tokenizer as the plain call
        assert type(load_tokenizer(tmp_path)) is type(AutoTokenizer.from_pretrained(str(tmp_path)))
