"""A config.json that lacks a field the engine needs, or gives one the wrong type, is a clear start-up error
naming the field (`loraplex serve` prints it and exits 1), not a traceback."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from core.config import ModelConfig
from gateway.cli import main
from tiny_models import TinyModelSpec, tiny_model_dir

BASE: dict[str, Any] = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                        "num_hidden_layers": 1, "num_attention_heads": 4}


@pytest.mark.parametrize("field", ["num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size",
                                   "intermediate_size"])
def test_a_missing_field_is_named(field: str) -> None:
    with pytest.raises(ValueError, match=f"lacks the field '{field}'"):
        ModelConfig.from_dict({k: v for k, v in BASE.items() if k != field})


def test_a_field_of_the_wrong_type_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="wrong type"):
        ModelConfig.from_dict({**BASE, "num_hidden_layers": None})
    assert ModelConfig.from_dict(BASE).num_layers == 1


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_serve_prints_the_field_and_exits_1(tmp_path: Path, engine_process: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir(TinyModelSpec()), model)
    cfg = json.loads((model / "config.json").read_text())
    del cfg["num_attention_heads"]
    (model / "config.json").write_text(json.dumps(cfg))
    code = main(["serve", "--model", str(model), "--device", "cpu", "--dtype", "float32", "--port", "0",
                 "--engine-process", engine_process])
    assert code == 1
    err = capsys.readouterr().err
    assert "cannot start with model" in err and "num_attention_heads" in err and "Traceback" not in err
