"""The server's frozen configuration (what `loraplex serve` parsed) and its mapping to the engine config."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # core pulls in torch: keep `loraplex --help` fast
    from core.config import EngineConfig

DEMO_SERVED_NAME = "loraplex-demo"
_BYTE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
               "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """`1073741824`, `512MiB`, `2GB`, `1.5g` -> bytes (decimal units for K/M/G, binary for KiB/MiB/GiB)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"not a byte size: {text!r} (use e.g. 2147483648, 512MiB, 2GB)")
    value = int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])
    if value <= 0:
        raise ValueError(f"byte size must be positive, got {text!r}")
    return value


def parse_lora_spec(text: str) -> tuple[str, str, str | None]:
    """`NAME=PATH` or vLLM's JSON `{"name", "path", "base_model_name"?}` -> (name, path, base_model_name)."""
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
        extra = sorted(set(obj) - {"name", "path", "base_model_name"}) if isinstance(obj, dict) else []
        if extra:
            raise ValueError(f"unknown keys {extra} (expected name, path, base_model_name)")
        name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
        if not (isinstance(name, str) and name.strip() and isinstance(path, str) and path.strip()) \
                or not isinstance(base, (str, type(None))):
            raise ValueError(f'expected {{"name": ..., "path": ..., "base_model_name": ...}}, got {text!r}')
        return name.strip(), path.strip(), base
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"expected NAME=PATH, got {text!r}")
    return name.strip(), path.strip(), None


@dataclass(frozen=True)
class ServerConfig:
    model: str                      # what the engine loads (a local dir or a hub id)
    served_model_name: str          # the base model's name in the `model` field and /v1/models
    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int | None = None          # a second listener with the full /metrics (None: none)
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    lora_modules: tuple[tuple[str, str], ...] = ()
    lora_dirs: tuple[str, ...] = ()          # --lora-dir: adapters served on first request
    max_loras: int = 8
    max_cpu_loras: int = 64
    max_lora_rank: int = 64
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    api_key: str | None = None
    tenant_keys: Path | None = None
    admin_token: str | None = None
    scheduling_policy: str = "fcfs"          # fcfs | fair (per-tenant virtual token counter)
    max_queue_len: int | None = 1024         # engine requests waiting + running; past it 429 (None: no bound)
    request_timeout: float | None = None     # seconds from arrival; None: no timeout
    shutdown_timeout: float = 30.0           # SIGTERM: seconds to let in-flight requests finish
    access_log: bool = True                  # one JSON line per request on the `loraplex.access` logger
    enforce_eager: bool = False              # CUDA: no decode graphs
    async_scheduling: bool | None = None     # overlap step t+1's CPU work with step t (None: on CUDA)
    load_format: str = "auto"                # "dummy": random weights (benchmarks on a model config)
    tensor_parallel_size: int = 1            # ranks the model is sharded over (one process each)
    quantization: str | None = None          # --quantization (checked against the checkpoint)
    speculative_config: Any = None           # core.spec.SpeculativeConfig (None: no speculative decoding)
    # vLLM's spellings (gateway/server/cli_vllm.py)
    served_model_aliases: tuple[str, ...] = ()   # more names of the base model (--served-model-name a b)
    chat_template: str | None = None         # the template text replacing the tokenizer's
    generation_config: str = "auto"          # auto | vllm | a directory holding generation_config.json
    tool_call_parser: str | None = None      # a tool-call family (None: read from the chat template)
    reasoning_parser: str | None = None      # deepseek_r1 | qwen3: <think> text -> reasoning_content
    log_requests: bool = False               # one info line per request: its parameters, never its text
    max_logprobs: int | None = None          # per-request cap (None: 5 on completions, 20 on chat)
    tokenizer: str | None = None             # a tokenizer dir or hub id other than the model's
    revision: str | None = None              # hub revision (branch, tag or commit) of --model
    download_dir: str | None = None          # the HF cache directory for hub ids
    trust_remote_code: bool = False
    uvicorn_log_level: str | None = None     # None: --log-level
    engine_process: bool = True              # --engine-process: the engine core in its own process (issue 27)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.served_model_aliases)

    @property
    def url(self) -> str:
        return self._url(self.port)

    @property
    def metrics_url(self) -> str | None:
        return None if self.metrics_port is None else self._url(self.metrics_port) + "/metrics"

    def _url(self, port: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{port}"

    def engine_config(self) -> "EngineConfig":
        from core.config import CacheConfig, EngineConfig, SchedulerConfig

        return EngineConfig(
            model=self.model, dtype=self.dtype, device=self.device, seed=self.seed,
            served_model_name=self.served_model_name,
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              enable_prefix_caching=self.enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_model_len=self.max_model_len, policy=self.scheduling_policy),
            max_loras=self.max_loras, max_cpu_loras=self.max_cpu_loras, max_lora_rank=self.max_lora_rank,
            lora_modules=self.lora_modules, lora_dirs=self.lora_dirs, enforce_eager=self.enforce_eager,
            load_format=self.load_format, async_scheduling=self.async_scheduling,
            tensor_parallel_size=self.tensor_parallel_size, tokenizer=self.tokenizer, revision=self.revision,
            download_dir=self.download_dir, trust_remote_code=self.trust_remote_code,
            chat_template=self.chat_template,
            quantization=self.quantization, speculative=self.speculative_config)
