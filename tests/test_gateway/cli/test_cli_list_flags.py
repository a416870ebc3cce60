"""List flags take both forms the synopsis promises (`--lora-dir A B` and `--lora-dir A --lora-dir B`), and
`--metrics-port` parses into the config."""
from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import build_parser, config_from_args
from gateway.server.config import ServerConfig


def parse(*argv: str) -> ServerConfig:
    parser = build_parser()
    return config_from_args(parser.parse_args(["serve", *argv]), parser)


def test_lora_dir_takes_several_values_and_repeats(tmp_path: Path) -> None:
    dirs = [tmp_path / name for name in "abc"]
    for d in dirs:
        d.mkdir()
    a, b, c = (str(d) for d in dirs)
    assert parse("--lora-dir", a, b).engine.lora.lora_dirs == (a, b)
    assert parse("--lora-dir", a, "--lora-dir", b).engine.lora.lora_dirs == (a, b)
    assert parse("--lora-dir", a, b, "--lora-dir", c, "--port", "9000").engine.lora.lora_dirs == (a, b, c)


def test_lora_dir_checks_every_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a").mkdir()
    with pytest.raises(SystemExit):
        parse("--lora-dir", str(tmp_path / "a"), str(tmp_path / "missing"))
    assert "--lora-dir" in capsys.readouterr().err


def test_lora_modules_take_several_values_and_repeat() -> None:
    expected = (("a", "/x"), ("b", "/y"), ("c", "/z"))
    assert parse("--lora-modules", "a=/x", "b=/y", "c=/z").engine.lora.lora_modules == expected
    assert parse("--lora-modules", "a=/x", "--lora-modules", "b=/y", "c=/z").engine.lora.lora_modules == expected
    with pytest.raises(SystemExit):
        parse("--lora-modules", "a=/x", "--lora-modules", "a=/y")   # a duplicate name across the two forms


def test_metrics_port(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse().metrics_port is None and parse().metrics_url is None
    cfg = parse("--host", "0.0.0.0", "--port", "8000", "--metrics-port", "8001")
    assert cfg.metrics_port == 8001 and cfg.metrics_url == "http://0.0.0.0:8001/metrics"
    with pytest.raises(SystemExit):
        parse("--port", "8000", "--metrics-port", "8000")
    assert "--metrics-port" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--metrics-port", "70000")
