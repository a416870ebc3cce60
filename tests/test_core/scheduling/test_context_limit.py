"""`--max-model-len` above what the model supports is refused at start-up (with the reason), as vLLM does,
unless LORAPLEX_ALLOW_LONG_MAX_MODEL_LEN=1 turns the refusal into a warning."""
from __future__ import annotations

import logging
from typing import Any

import pytest

from core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from core.scheduling.context_limit import check_max_model_len, supported_max_len
from envlib import setenv
from core.engine.setup import resolve_model_files
from gateway.cli import main
from tiny_models import TinyModelSpec, tiny_model_dir

ALLOW_LONG_ENV = "LORAPLEX_ALLOW_LONG_MAX_MODEL_LEN"
BASE: dict[str, Any] = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                        "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 4096}


def cfg(**extra: Any) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **extra})


@pytest.mark.parametrize("scaling, expected", [
    (None, 4096),
    ({"rope_type": "default"}, 4096),
    ({"rope_type": "linear", "factor": 2.0}, 8192),
    ({"type": "dynamic", "factor": 4.0}, 16384),                                   # transformers 4.x spelling
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}, 8192),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 512}, 4096),  # already extended
])
def test_supported_max_len_follows_the_rope_scaling(scaling: dict[str, Any] | None, expected: int) -> None:
    limit = supported_max_len(cfg(rope_scaling=scaling))
    assert limit.num_tokens == expected
    assert "max_position_embeddings" in limit.reason


def test_gemma3_linear_scaling_does_not_stretch_the_context() -> None:
    """Gemma 3's max_position_embeddings already is the context of its scaled global layers (vLLM does not
    multiply it by the factor either): 131072, not 1M."""
    gemma3 = cfg(model_type="gemma3_text", max_position_embeddings=131072,
                 rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert supported_max_len(gemma3).num_tokens == 131072


def test_check_refuses_past_the_limit_and_names_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_LONG_ENV, raising=False)
    model = cfg(rope_scaling={"rope_type": "linear", "factor": 2.0})
    check_max_model_len(None, model)
    check_max_model_len(8192, model)
    with pytest.raises(ValueError) as err:
        check_max_model_len(8193, model)
    message = str(err.value)
    assert "8193" in message and "8192" in message and "linear" in message and ALLOW_LONG_ENV in message


def test_the_environment_variable_turns_the_refusal_into_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(ALLOW_LONG_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="loraplex.engine"):
        check_max_model_len(10_000, cfg())
    assert any("10000" in r.getMessage() and ALLOW_LONG_ENV in r.getMessage() for r in caplog.records)
    setenv(monkeypatch, ALLOW_LONG_ENV, "0")
    with pytest.raises(ValueError):
        check_max_model_len(10_000, cfg())


def _engine_config(model: str, max_model_len: int) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", dtype="float32", cache=CacheConfig(num_blocks=8),
                        scheduler=SchedulerConfig(max_model_len=max_model_len))


def test_engine_setup_applies_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    model = str(tiny_model_dir(TinyModelSpec(max_position_embeddings=1024)))
    monkeypatch.delenv(ALLOW_LONG_ENV, raising=False)
    assert resolve_model_files(_engine_config(model, 1024)).max_model_len == 1024
    with pytest.raises(ValueError, match="max_position_embeddings=1024"):
        resolve_model_files(_engine_config(model, 2048))
    setenv(monkeypatch, ALLOW_LONG_ENV, "1")
    assert resolve_model_files(_engine_config(model, 2048)).max_model_len == 2048


def test_serve_refuses_to_start_with_the_reason(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`loraplex serve` exits 1 before loading any weight, with the reason on stderr."""
    monkeypatch.delenv(ALLOW_LONG_ENV, raising=False)
    model = str(tiny_model_dir(TinyModelSpec(max_position_embeddings=1024)))
    code = main(["serve", "--model", model, "--device", "cpu", "--dtype", "float32", "--max-model-len", "4096",
                 "--port", "0"])
    assert code == 1
    err = capsys.readouterr().err
    assert "--max-model-len 4096" in err and "1024" in err and ALLOW_LONG_ENV in err

