"""`loraplex serve ...`: the command line of DESIGN.md, parsed into a frozen `ServerConfig`."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from core.config import (DEMO_MODEL_DIR, CacheConfig, EngineConfig, LoRAConfig, ParallelConfig, QuantizationConfig,
                         SchedulerConfig)
from core.environment.variables import ENGINE_PROCESS, check_all
from gateway.server.cli_vllm import (add_vllm_arguments, lora_modules, prefix_caching, resolve_model, served_names,
                                     vllm_engine_fields, vllm_server_fields)
from gateway.server.config import DEMO_SERVED_NAME, ServerConfig, parse_bytes, parse_lora_spec
from gateway.server.config_file import expand_config
from gateway.server.listeners import ListenError, bind_ports
from gateway.tenancy.tenants import TenantFileError, load_tenant_file
from core.spec import SpeculativeConfig, SpeculativeConfigError


def _typed(kind: Callable[[str], object], check: Callable[[object], bool], what: str) -> Callable[[str], object]:
    def convert(text: str) -> object:
        try:
            value = kind(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc) or f"invalid value {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    convert.__name__ = what
    return convert


_POS_INT = _typed(int, lambda v: v > 0, "a positive integer")          # type: ignore[operator]
_PORT = _typed(int, lambda v: 0 <= v <= 65535, "a TCP port")           # type: ignore[operator]
_FRACTION = _typed(float, lambda v: 0.0 < v <= 1.0, "in (0, 1]")      # type: ignore[operator]
_BYTES = _typed(parse_bytes, lambda v: True, "a byte size")
_LORA = _typed(parse_lora_spec, lambda v: True, "NAME=PATH or JSON")
_NONNEG_INT = _typed(int, lambda v: v >= 0, "a non-negative integer")        # type: ignore[operator]
_DIR = _typed(str, lambda v: Path(str(v)).is_dir(), "a directory")
_MS = _typed(float, lambda v: 0.0 <= v < float("inf"), "a number of milliseconds >= 0")  # type: ignore[operator]
_SECONDS = _typed(float, lambda v: 0.0 <= v < float("inf"), "a number of seconds >= 0")  # type: ignore[operator]


class _Parser(argparse.ArgumentParser):
    """The `loraplex` parser: `serve --config FILE` (gateway/server/config_file.py) expands before parsing."""

    serve: argparse.ArgumentParser | None = None

    def parse_known_args(self, args: Sequence[str] | None = None,   # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        if self.serve is not None and argv[:1] == ["serve"] and any(a == "--config" or a.startswith("--config=")
                                                                     for a in argv):
            try:
                argv = ["serve", *expand_config(argv[1:], self.serve)]
            except ValueError as exc:
                self.serve.error(str(exc))
        return super().parse_known_args(argv, namespace)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loraplex", description="Multi-LoRA LLM serving engine.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    s = parser.serve = sub.add_parser("serve", help="serve a base model (and its LoRA adapters) over an "
                                      "OpenAI-compatible API")
    s.add_argument("--config", default=None, metavar="YAML",
                   help="vLLM's flags file: a YAML mapping of these flags (model, port, max-model-len: ...); "
                        "a flag also given on the command line takes the command line's value")
    s.add_argument("--model", default=None, help="local HF model dir or hub id (default: the embedded demo model)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="name(s) of the base model in the API (default: --model); answers carry the first")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_PORT, default=8000)
    s.add_argument("--metrics-port", type=_PORT, default=None, metavar="PORT",
                   help="also serve the full /metrics (tenant and adapter labels) on this port of --host, for "
                        "Prometheus and the endpoint picker; with --tenant-keys the main port's /metrics has none")
    s.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    s.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--lora-modules", type=_LORA, nargs="+", action="extend", default=[], metavar="NAME=PATH",
                   help='NAME=PATH, or vLLM\'s JSON {"name": ..., "path": ..., "base_model_name": ...}')
    s.add_argument("--lora-dir", type=_DIR, nargs="+", action="extend", default=[], metavar="DIR",
                   help="serve every PEFT adapter folder below DIR by its relative path (acme/support-v2), "
                        "loaded on the first request that names it (several DIRs, or the flag repeated)")
    s.add_argument("--max-loras", type=_POS_INT, default=8)
    s.add_argument("--max-cpu-loras", type=_POS_INT, default=64)
    s.add_argument("--max-lora-rank", type=_POS_INT, default=64)
    s.add_argument("--block-size", type=_POS_INT, default=16)
    pool = s.add_mutually_exclusive_group()
    pool.add_argument("--kv-cache-memory", type=_BYTES, default=None, metavar="BYTES")
    pool.add_argument("--gpu-memory-utilization", type=_FRACTION, default=0.9)
    s.add_argument("--max-num-seqs", type=_POS_INT, default=256)
    s.add_argument("--max-num-batched-tokens", type=_POS_INT, default=2048)
    s.add_argument("--max-model-len", type=_POS_INT, default=None, metavar="N")
    s.add_argument("--max-step-ms", type=_MS, default=None, metavar="MS",
                   help="while requests decode, size each step's prefill chunks so its predicted time stays under "
                        "MS milliseconds (a step-time model learned online; 0: off; default: auto, 1.8x the "
                        "predicted decode-only step); --max-num-batched-tokens stays the hard cap")
    s.add_argument("--no-prefix-caching", action="store_true")
    s.add_argument("--api-key", default=None, metavar="KEY")
    s.add_argument("--tenant-keys", type=Path, default=None, metavar="FILE")
    s.add_argument("--admin-token", default=None, metavar="TOKEN")
    s.add_argument("--scheduling-policy", choices=("fcfs", "fair", "priority"), default="fcfs",
                   help="fair: share throughput between tenants (virtual token counter); priority: by each "
                        "request's `priority` field, lower first (vLLM's; a tenant's floor in --tenant-keys)")
    s.add_argument("--max-queue-len", type=_NONNEG_INT, default=1024, metavar="N",
                   help="engine requests waiting + running before new ones get 429 queue_full (0: no bound)")
    s.add_argument("--request-timeout", type=_SECONDS, default=0.0, metavar="SECONDS",
                   help="abort a request this long after it arrived: 408, or an in-band error when streaming "
                        "(0: off)")
    s.add_argument("--shutdown-timeout", type=_SECONDS, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, let in-flight requests finish for this long, then exit")
    s.add_argument("--no-access-log", action="store_true", help="no JSON access-log lines on stdout")
    s.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly (no decode CUDA graphs; faster start-up, slower decode)")
    s.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                   help="launch step t+1 before reading step t's tokens, so the CPU's scheduling, "
                        "detokenization and grammar work overlaps the GPU (auto: on with CUDA)")
    s.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights of the model config's shape (benchmarks)")
    s.add_argument("-tp", "--tensor-parallel-size", type=_POS_INT, default=1, metavar="N",
                   help="shard the model over N ranks (one process each; N GPUs on CUDA, gloo on CPU)")
    s.add_argument("--quantization", choices=("compressed-tensors", "gptq", "awq", "fp8"), default=None,
                   help="checked against the checkpoint's quantization_config; fp8 on an unquantized one: online FP8")
    s.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4} (optional "disable_by_batch_size")')
    s.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="warning")
    s.add_argument("--engine-process", choices=("on", "off"), default=None,
                   help="run the engine core in its own process, fed over ZMQ (default on; unset, "
                        "LORAPLEX_ENGINE_PROCESS=0 turns it off; off: the engine loop is a thread of the API process)")
    add_vllm_arguments(s)
    return parser


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServerConfig:
    """The server's config and, inside it, the engine's (built here, once). Imports no torch."""
    model_arg = resolve_model(args, parser)
    if model_arg is None:
        model, default_name = str(DEMO_MODEL_DIR), DEMO_SERVED_NAME
    else:
        model = default_name = model_arg
    names = served_names(args, default_name, parser)
    if args.tenant_keys is not None and not args.tenant_keys.is_file():
        parser.error(f"--tenant-keys: no such file: {args.tenant_keys}")
    _check_ports(args, parser)
    if args.api_key is not None and not args.api_key:
        parser.error("--api-key must not be empty")
    _check_environment(parser)
    if args.tenant_keys is not None:
        _check_tenant_file(args, parser)
    elif args.admin_token is not None and args.admin_token == args.api_key:
        parser.error("--admin-token must differ from --api-key (the admin token is never an API key)")
    engine = EngineConfig(
        model=model, dtype=args.dtype, device=args.device, seed=args.seed,
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=prefix_caching(args, parser)),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len, policy=args.scheduling_policy,
                                  max_step_ms=args.max_step_ms),
        lora=LoRAConfig(max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras,
                        max_lora_rank=args.max_lora_rank, lora_modules=lora_modules(args, model, names, parser),
                        lora_dirs=tuple(args.lora_dir)),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
        speculative=args.speculative_config, quantization=QuantizationConfig(method=args.quantization),
        load_format=args.load_format, enforce_eager=args.enforce_eager,
        async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
        **vllm_engine_fields(args))
    return ServerConfig(
        engine=engine, served_model_name=names[0], served_model_aliases=names[1:], host=args.host, port=args.port,
        metrics_port=args.metrics_port, api_key=args.api_key, tenant_keys=args.tenant_keys,
        admin_token=args.admin_token, max_queue_len=args.max_queue_len or None,
        request_timeout=args.request_timeout or None, shutdown_timeout=args.shutdown_timeout,
        engine_process=engine_process_enabled(args, parser), **vllm_server_fields(args, parser))


def _check_ports(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.metrics_port is not None and args.metrics_port == args.port and args.port != 0:
        parser.error("--metrics-port must differ from --port")


def _check_environment(parser: argparse.ArgumentParser) -> None:
    """Every LORAPLEX_* variable (core/environment/variables.py), checked before anything starts: a bad one is named."""
    errors = check_all()
    if errors:
        parser.error("; ".join(errors))


def _speculative_config(text: str) -> Any:
    try:
        return SpeculativeConfig.parse(text)
    except SpeculativeConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engine_process_enabled(args: argparse.Namespace, parser: argparse.ArgumentParser) -> bool:
    """`--engine-process on|off` (vLLM's `--disable-frontend-multiprocessing`: off); unset:
    `LORAPLEX_ENGINE_PROCESS` (0: off, 1: on), default on."""
    if args.disable_frontend_multiprocessing:
        if args.engine_process == "on":
            parser.error("--disable-frontend-multiprocessing contradicts --engine-process on")
        return False
    if args.engine_process is not None:
        return args.engine_process == "on"
    return ENGINE_PROCESS.get()


def _check_tenant_file(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Validates --tenant-keys at start-up; keys never appear in the messages."""
    try:
        keys = load_tenant_file(args.tenant_keys)
    except TenantFileError as exc:
        parser.error(f"--tenant-keys: {exc}")
    if args.api_key is not None and keys.has_key(args.api_key):
        parser.error("--api-key is also a tenant key in --tenant-keys; the superuser key must be distinct")
    if args.admin_token is not None and (keys.has_key(args.admin_token) or args.admin_token == args.api_key):
        parser.error("--admin-token must differ from --api-key and every tenant key")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":
        parser.print_help(sys.stderr)
        return 2
    # the ports first, before torch is imported or the model loaded: a port in use ends this within a second
    _check_ports(args, parser)
    try:
        ports = bind_ports(args.host, args.port, args.metrics_port)
    except ListenError as exc:
        print(f"loraplex: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        config = config_from_args(args, parser)
        from gateway.server.server import serve  # torch: kept out of the CLI's --help path

        return serve(config, log_level=args.log_level, ports=ports)
    except KeyboardInterrupt:  # interrupted while loading the model
        return 130
    finally:
        ports.close()


def console_main() -> None:
    """The `loraplex` console script (and `python -m gateway`). Once `serve` has returned, the engine, its
    threads and any tensor-parallel workers are shut down and the logs flushed: the process then exits at
    once instead of garbage-collecting the model's tensors one by one (about a second of teardown)."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    console_main()
