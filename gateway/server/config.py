"""The server's frozen configuration (what `loraplex serve` parsed): its own settings and the engine's config."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import EngineConfig   # torch-free: `loraplex --help` stays fast

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
    """The server's own settings; the engine's are its `EngineConfig`, built once by the CLI."""

    engine: EngineConfig                     # what the engine loads and how it runs (core/config.py)
    served_model_name: str                   # the base model's name in the `model` field and /v1/models
    served_model_aliases: tuple[str, ...] = ()   # more names of the base model (--served-model-name a b)
    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int | None = None          # a second listener with the full /metrics (None: none)
    api_key: str | None = None
    tenant_keys: Path | None = None
    admin_token: str | None = None
    max_queue_len: int | None = 1024         # engine requests waiting + running; past it 429 (None: no bound)
    request_timeout: float | None = None     # seconds from arrival; None: no timeout
    shutdown_timeout: float = 30.0           # SIGTERM: seconds to let in-flight requests finish
    access_log: bool = True                  # one JSON line per request on the `loraplex.access` logger
    log_requests: bool = False               # one info line per request: its parameters, never its text
    uvicorn_log_level: str | None = None     # None: --log-level
    engine_process: bool = True              # --engine-process: the engine core in its own process (issue 27)
    # what the API does with requests and outputs (vLLM's spellings: gateway/server/cli_vllm.py)
    generation_config: str = "auto"          # auto | vllm | a directory holding generation_config.json
    override_generation_config: tuple[tuple[str, Any], ...] = ()   # (key, value) over its defaults (vLLM's flag)
    tool_call_parser: str | None = None      # a tool-call family (None: read from the chat template)
    reasoning_parser: str | None = None      # deepseek_r1 | qwen3: <think> text -> reasoning_content
    max_logprobs: int | None = None          # per-request cap (None: 5 on completions, 20 on chat)
    openapi: bool = True                     # GET /openapi.json (vLLM's --disable-fastapi-docs turns it off)
    # CORS (vLLM's --allowed-origins etc.): no CORS headers unless origins are given (vLLM's default is "*")
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # TLS on the API port (vLLM's --ssl-* flags; uvicorn's): a PEM certificate chain and its key, client CAs
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0                   # ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED (client certificates)
    return_tokens_as_token_ids: bool = False   # logprob tokens named "token_id:<id>" unless a request says
    root_path: str = ""                      # vLLM's --root-path: the prefix a path-routing proxy serves us under
    response_role: str = "assistant"         # vLLM's --response-role: a chat answer's role (a new turn)
    force_include_usage: bool = False        # vLLM's --enable-force-include-usage: every stream ends with `usage`

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.served_model_aliases)

    @property
    def url(self) -> str:
        return self._url(self.port, tls=self.ssl_certfile is not None)

    @property
    def metrics_url(self) -> str | None:
        return None if self.metrics_port is None else self._url(self.metrics_port) + "/metrics"

    def _url(self, port: int, tls: bool = False) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if tls else 'http'}://{host}:{port}"
