"""`loraplex serve` flags (DESIGN.md contract) parse into the frozen ServerConfig and the engine config."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import (DEMO_MODEL_DIR, CacheConfig, EngineConfig, LoRAConfig, ParallelConfig, QuantizationConfig,
                         SchedulerConfig)
from gateway.cli import build_parser, config_from_args
from gateway.server.config import DEMO_SERVED_NAME, ServerConfig, parse_bytes


def parse(*argv: str) -> ServerConfig:
    parser = build_parser()
    return config_from_args(parser.parse_args(["serve", *argv]), parser)


def test_every_contract_flag_parses(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.json"
    tenants.write_text('{"tenants": {}}')
    cfg = parse("--model", "some/model", "--served-model-name", "base", "--host", "0.0.0.0", "--port", "9001",
                "--device", "cpu", "--dtype", "bfloat16", "--max-loras", "4", "--max-cpu-loras", "32",
                "--max-lora-rank", "16", "--block-size", "32", "--kv-cache-memory", "1GiB", "--max-num-seqs", "8",
                "--max-num-batched-tokens", "512", "--max-model-len", "1024", "--no-prefix-caching",
                "--api-key", "sk-1", "--tenant-keys", str(tenants), "--admin-token", "adm", "--seed", "3")
    assert (cfg.served_model_name, cfg.host, cfg.port) == ("base", "0.0.0.0", 9001)
    assert (cfg.api_key, cfg.tenant_keys, cfg.admin_token) == ("sk-1", tenants, "adm")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]
    eng = cfg.engine
    assert (eng.model, eng.device, eng.dtype, eng.seed) == ("some/model", "cpu", "bfloat16", 3)
    assert eng.cache == CacheConfig(block_size=32, kv_cache_memory=1 << 30, enable_prefix_caching=False)
    assert eng.scheduler == SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024)
    assert eng.lora == LoRAConfig(max_loras=4, max_cpu_loras=32, max_lora_rank=16)
    assert eng.parallel == ParallelConfig() and eng.quantization == QuantizationConfig() and eng.speculative is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        eng.lora.max_loras = 1  # type: ignore[misc]


def test_defaults() -> None:
    demo = parse()
    assert demo.engine.model == str(DEMO_MODEL_DIR) and demo.served_model_name == DEMO_SERVED_NAME
    assert (demo.host, demo.port, demo.engine.device, demo.engine.dtype) == ("127.0.0.1", 8000, "auto", "auto")
    assert demo.engine == EngineConfig(model=str(DEMO_MODEL_DIR))   # the engine's defaults are the CLI's
    assert parse("--model", "/x/y").served_model_name == "/x/y"
    assert parse("--gpu-memory-utilization", "0.5").engine.cache.gpu_memory_utilization == 0.5


@pytest.mark.parametrize("argv,needle", [
    (["--kv-cache-memory", "1G", "--gpu-memory-utilization", "0.5"], "not allowed with"),
    (["--device", "tpu"], "invalid choice"),
    (["--port", "70000"], "--port"),
    (["--max-loras", "0"], "--max-loras"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["--tenant-keys", "/no/such/file.json"], "--tenant-keys"),
    (["--lora-modules", "missing-path"], "--lora-modules"),
    (["--max-step-ms", "-1"], "--max-step-ms"),
    (["--max-step-ms", "nan"], "--max-step-ms"),
    (["--max-step-ms", "inf"], "--max-step-ms"),
    (["--max-step-ms", "fast"], "--max-step-ms"),
])
def test_bad_flags_exit_with_a_message(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_max_step_ms_reaches_the_scheduler_config() -> None:
    assert parse().engine.scheduler.max_step_ms is None                       # auto
    assert parse("--max-step-ms", "0").engine.scheduler.max_step_ms == 0.0    # off
    assert parse("--max-step-ms", "37.5").engine.scheduler.max_step_ms == 37.5


def test_parse_bytes() -> None:
    assert parse_bytes("1024") == 1024
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes("3k") == 3000
    for bad in ("", "abc", "-5", "0", "12 parsecs"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_console_entry_points() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway", "serve", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0
    for flag in ("--model", "--served-model-name", "--lora-modules", "--max-loras", "--kv-cache-memory",
                 "--gpu-memory-utilization", "--no-prefix-caching", "--api-key", "--tenant-keys", "--admin-token"):
        assert flag in out.stdout
    bare = subprocess.run([sys.executable, "-m", "gateway"], capture_output=True, text=True, timeout=120)
    assert bare.returncode == 2


def test_lora_dir_is_repeatable_and_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cfg = parse("--lora-dir", str(tmp_path / "a"), "--lora-dir", str(tmp_path / "b"))
    assert cfg.engine.lora.lora_dirs == (str(tmp_path / "a"), str(tmp_path / "b"))
    assert parse().engine.lora.lora_dirs == ()
    with pytest.raises(SystemExit):
        parse("--lora-dir", str(tmp_path / "missing"))
    assert "--lora-dir" in capsys.readouterr().err
