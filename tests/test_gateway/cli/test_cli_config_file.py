"""`loraplex serve --config FILE` (vLLM's YAML flags file): every kind of flag from the file, the command line
winning over it, and every malformed file refused with its reason (exit 2), never an ignored setting."""
from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import build_parser, config_from_args
from gateway.server.config import ServerConfig

FILE = """
model: /m
port: 9001
max_model_len: 512
enable-prefix-caching: false
served-model-name: [a, b]
lora-modules:
  - x=/p/x
  - '{"name": "y", "path": "/p/y"}'
speculative-config: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
return-tokens-as-token-ids: true
"""


def parse(*argv: str) -> ServerConfig:
    parser = build_parser()
    return config_from_args(parser.parse_args(["serve", *argv]), parser)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return str(path)


def test_every_kind_of_flag_from_the_file(tmp_path: Path) -> None:
    cfg = parse("--config", write(tmp_path, FILE))
    eng = cfg.engine
    assert (cfg.port, eng.model, cfg.served_model_names, eng.scheduler.max_model_len) == (9001, "/m", ("a", "b"), 512)
    assert not eng.cache.enable_prefix_caching and cfg.return_tokens_as_token_ids
    assert eng.lora.lora_modules == (("x", "/p/x"), ("y", "/p/y"))
    assert eng.speculative is not None and eng.speculative.num_speculative_tokens == 3
    assert parse(f"--config={write(tmp_path, FILE)}").port == 9001    # the = spelling


def test_the_command_line_wins(tmp_path: Path) -> None:
    path = write(tmp_path, FILE)
    cfg = parse("--port", "9002", "--config", path, "--max-model-len", "256", "--enable-prefix-caching")
    assert (cfg.port, cfg.engine.scheduler.max_model_len, cfg.engine.cache.enable_prefix_caching) == (9002, 256, True)
    assert parse("/other", "--config", path).engine.model == "/other"    # positional, after the file's list flags
    assert parse("--config", path, "--model", "/third").engine.model == "/third"
    assert parse("--config", write(tmp_path, "")).engine.model.endswith("demo_model")   # an empty file: no flags


@pytest.mark.parametrize("text, needle", [
    ("max-modle-len: 5\n", "unknown flag 'max-modle-len'"),
    ("config: other.yaml\n", "unknown flag 'config'"),
    ("port: [1, 2]\n", "port takes one value"),
    ("enforce-eager: 1\n", "enforce-eager is a switch"),
    ("enable-prefix-caching: maybe\n", "true or false"),
    ("- port\n- 8000\n", "must be a mapping"),
    ("port: [\n", "is not YAML"),
    ("max-model-len: -3\n", "--max-model-len"),            # the flag's own check still applies
])
def test_malformed_files_are_refused(tmp_path: Path, text: str, needle: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse("--config", write(tmp_path, text))
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_missing_or_oversized_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, needle in ((["--config", str(tmp_path / "nope.yaml")], "cannot read"),
                         (["--config", write(tmp_path, "# " + "x" * (1 << 20))], "larger than"),
                         (["--config"], "--config needs a file")):
        with pytest.raises(SystemExit) as info:
            parse(*argv)
        assert info.value.code == 2 and needle in capsys.readouterr().err
