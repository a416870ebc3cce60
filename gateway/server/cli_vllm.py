"""vLLM's `serve` flags, with vLLM's meaning, so a vLLM launch line starts loraplex unchanged.

Each flag either does what it does in vLLM, is accepted because loraplex always behaves that way (said in
its help), or is refused with the reason; anything else stays argparse's "unrecognized arguments" error.
docs/cli.md ("Coming from vLLM") lists them all.
"""
from __future__ import annotations

import argparse
import codecs
import json
import ssl
from pathlib import Path
from typing import Any, Callable

from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from adapters.registry.lora_dirs import valid_name     # torch-free
from gateway.reasoning.reasoning import REASONING_PARSERS
from gateway.tools.tool_parsers import TOOL_CALL_PARSERS

ALWAYS = "accepted (vLLM compatibility)"


def _kv_cache_dtype(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(f"{text!r} is not supported: the KV cache has the model's dtype (auto)")
    return text


def _tool_call_parser(text: str) -> str:
    if text not in TOOL_CALL_PARSERS:
        raise argparse.ArgumentTypeError(f"no tool-call parser {text!r}; loraplex has "
                                         f"{', '.join(sorted(TOOL_CALL_PARSERS))}")
    return text


def _reasoning_parser(text: str) -> str:
    if text not in REASONING_PARSERS:
        raise argparse.ArgumentTypeError(f"no reasoning parser {text!r}; loraplex has {', '.join(REASONING_PARSERS)}")
    return text


def _generation_config(text: str) -> str:
    if text in ("auto", "vllm"):
        return text
    if not (Path(text) / "generation_config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not auto, vllm or a directory with generation_config.json")
    return text


def _generation_overrides(text: str) -> tuple[tuple[str, Any], ...]:
    """A JSON object of generation-config keys (its keys and values are checked at start-up, with the file's)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError('expected a JSON object, e.g. \'{"temperature": 0.5}\'')
    return tuple(data.items())


def _string_list(text: str) -> tuple[str, ...]:
    """vLLM's CORS flags: a JSON list of strings, e.g. '["https://app.example.com"]' or '["*"]'."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}); expected a list such as '[\"*\"]'") from None
    if not isinstance(data, list) or not all(isinstance(x, str) and x for x in data):
        raise argparse.ArgumentTypeError('expected a JSON list of non-empty strings, such as \'["*"]\'')
    return tuple(data)


def _tokenizer_mode(text: str) -> str:
    if text not in ("auto", "hf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not supported: loraplex loads the HF fast tokenizer "
                                         f"(auto; hf is its other name)")
    return text


def _lora_dtype(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(f"{text!r} is not supported: adapters take the model's dtype (auto)")
    return text


def _swap_space(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in GiB >= 0")
    return value


def load_chat_template(text: str) -> str:
    """vLLM's rule: the file's content when `text` names a readable file; otherwise `text` itself is the
    template (escape sequences such as \\n decoded), unless it looks like a path (no `{`, `}` or newline)."""
    try:
        Path(text).expanduser().read_text()
    except OSError as exc:
        if not any(c in text for c in "{}\n"):
            raise argparse.ArgumentTypeError(f"{text!r} looks like a file path but cannot be read: {exc}") from None
        text = codecs.decode(text, "unicode_escape")
    else:
        text = Path(text).expanduser().read_text()
    _check_template(text)
    return text


def _check_template(text: str) -> None:
    """Compiles the template as transformers will render it (its extensions, e.g. `{% generation %}`)."""
    try:
        # torch: transformers is kept out of the CLI's --help path
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:   # another transformers layout: jinja's sandbox with the loop controls
        compile_template = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse
    try:
        compile_template(text)
    except TemplateSyntaxError as exc:
        raise argparse.ArgumentTypeError(f"not a valid Jinja template: {exc} (line {exc.lineno})") from None


def _typed(convert: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    def wrapped(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    wrapped.__name__ = name
    return wrapped


def add_vllm_arguments(s: argparse.ArgumentParser) -> None:
    """The positional model and vLLM's flags on the `serve` subcommand."""
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` (same as --model)")
    g = s.add_argument_group("vLLM compatibility (docs/cli.md: Coming from vLLM)")
    g.add_argument("--enable-lora", action="store_true", help=f"{ALWAYS}: adapters are always on")
    g.add_argument("--chat-template", type=_typed(load_chat_template, "chat template"), default=None,
                   metavar="FILE_OR_TEMPLATE", help="a Jinja chat template (file or text) replacing the tokenizer's")
    g.add_argument("--generation-config", type=_typed(_generation_config, "generation config"), default="auto",
                   metavar="auto|vllm|DIR", help="auto: sampling defaults from the model's generation_config.json "
                   "for requests that omit them; vllm: none; DIR: that folder's generation_config.json")
    g.add_argument("--override-generation-config", type=_typed(_generation_overrides, "generation config override"),
                   default=(), metavar="JSON", help="sampling defaults over --generation-config's, e.g. "
                   "'{\"temperature\": 0.5}' (keys: temperature, top_p, top_k, min_p, repetition_penalty, "
                   "max_new_tokens; with vllm, the only ones)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help=f"{ALWAYS}: tool_choice auto works without it")
    g.add_argument("--tool-call-parser", type=_tool_call_parser, default=None, metavar="NAME",
                   help=f"the tool-call format ({', '.join(sorted(TOOL_CALL_PARSERS))}; default: read from "
                        f"the chat template)")
    g.add_argument("--reasoning-parser", type=_reasoning_parser, default=None, metavar="NAME",
                   help=f"split <think>...</think> into reasoning_content ({', '.join(REASONING_PARSERS)})")
    g.add_argument("--disable-log-requests", action="store_true",
                   help=f"{ALWAYS}: request contents are never logged")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's parameters (never its text) at info")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="same as --no-access-log")
    g.add_argument("--disable-log-stats", action="store_true",
                   help=f"{ALWAYS}: no periodic stats lines; /metrics has them")
    g.add_argument("--uvicorn-log-level", choices=("critical", "error", "warning", "info", "debug", "trace"),
                   default=None, help="uvicorn's log level (default: --log-level)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help=f"{ALWAYS}: chunked prefill is always on; --no-enable-chunked-prefill is refused")
    g.add_argument("--kv-cache-dtype", type=_kv_cache_dtype, default="auto", metavar="auto")
    g.add_argument("--tokenizer-mode", type=_tokenizer_mode, default="auto", metavar="auto",
                   help=f"{ALWAYS}: the HF fast tokenizer (auto, hf); slow, mistral and custom are refused")
    g.add_argument("--lora-dtype", type=_lora_dtype, default="auto", metavar="auto",
                   help=f"{ALWAYS}: adapters take the model's dtype; other values are refused")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /openapi.json (vLLM's flag also removes /docs and /redoc, which loraplex does not serve)")
    g.add_argument("--swap-space", type=_typed(_swap_space, "GiB"), default=None, metavar="GiB",
                   help=f"{ALWAYS}: preempted requests are recomputed, never swapped")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="let a tokenizer run its own code; a model needing its own modelling code is refused")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="on by default; --no-enable-prefix-caching is --no-prefix-caching")
    g.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                   help="per-request logprobs cap (default: 5 on completions, 20 on chat; -1: the vocabulary)")
    g.add_argument("--allowed-origins", type=_typed(_string_list, "origin list"), default=(), metavar="JSON",
                   help="CORS: origins a browser page may call from, e.g. '[\"https://app.example.com\"]' or "
                        "'[\"*\"]' (default: none, no CORS headers; vLLM's default is every origin)")
    g.add_argument("--allowed-methods", type=_typed(_string_list, "method list"), default=("*",), metavar="JSON",
                   help="CORS: the methods allowed (default '[\"*\"]'; only with --allowed-origins)")
    g.add_argument("--allowed-headers", type=_typed(_string_list, "header list"), default=("*",), metavar="JSON",
                   help="CORS: the request headers allowed (default '[\"*\"]'; only with --allowed-origins)")
    g.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (cookies); only with --allowed-origins")
    g.add_argument("--ssl-certfile", default=None, metavar="PEM", help="serve HTTPS: the certificate (chain) file")
    g.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the certificate's private key (if not in it)")
    g.add_argument("--ssl-ca-certs", default=None, metavar="PEM", help="CA certificates to verify clients' with")
    g.add_argument("--ssl-cert-reqs", type=int, choices=(0, 1, 2), default=0,
                   help="client certificates: 0 none (default), 1 optional, 2 required (Python's ssl.CERT_*)")
    g.add_argument("--root-path", type=_typed(_root_path, "path prefix"), default="", metavar="PREFIX",
                   help="behind a proxy that serves this server under a path prefix (e.g. /llm), stripped or not: "
                        "/openapi.json names the prefix as its server (FastAPI's root_path, as vLLM's)")
    g.add_argument("--response-role", type=_typed(_response_role, "role"), default="assistant", metavar="ROLE",
                   help="the role of a chat answer that opens a new turn (default assistant; one that continues "
                        "the last message, add_generation_prompt false, takes that message's role)")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="every completions and chat stream ends with its usage chunk, as if it set "
                        "stream_options.include_usage")
    g.add_argument("--enable-server-load-tracking", action="store_true",
                   help=f"{ALWAYS}: GET /load answers the requests in flight")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help=f"{ALWAYS}: usage has prompt_tokens_details.cached_tokens")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help=f"{ALWAYS}: every answer carries X-Request-Id")
    g.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help=f"{ALWAYS}: no prompt text or ids are ever logged")
    g.add_argument("--disable-frontend-multiprocessing", action="store_true",
                   help="the engine loop runs on a thread of the API process (= --engine-process off)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="name logprob tokens 'token_id:<id>' (a request's return_tokens_as_token_ids overrides)")
    g.add_argument("--tokenizer", default=None, metavar="DIR_OR_HUB_ID", help="a tokenizer other than the model's")
    g.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) of the model")
    g.add_argument("--download-dir", default=None, metavar="DIR", help="the HF cache directory for hub ids")


def resolve_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """The positional model or --model (both: they must agree)."""
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        parser.error(f"the positional model {args.model_tag!r} and --model {args.model!r} differ; give one")
    return args.model_tag if args.model_tag is not None else args.model


def served_names(args: argparse.Namespace, default: str, parser: argparse.ArgumentParser) -> tuple[str, ...]:
    names = tuple(args.served_model_name or (default,))
    if len(set(names)) != len(names) or not all(n.strip() for n in names):
        parser.error("--served-model-name: names must be distinct and non-empty")
    return names


def lora_modules(args: argparse.Namespace, model: str, names: tuple[str, ...],
                 parser: argparse.ArgumentParser) -> tuple[tuple[str, str], ...]:
    """(name, path) pairs. A JSON entry's `base_model_name` must name the served model (a served name or the
    --model value): vLLM silently ignores any other; loraplex serves one base model and refuses it."""
    pairs = tuple((name, path) for name, path, _ in args.lora_modules)
    if len({name for name, _ in pairs}) != len(pairs):
        parser.error("--lora-modules: duplicate adapter name")
    for name, _, base in args.lora_modules:
        if not valid_name(name):   # the admin API's and --lora-dir's rule, checked before the model loads
            parser.error(f"--lora-modules: bad adapter name {name[:64]!r}: at most 512 characters, no NUL, "
                         "backslash or comma, no leading '/', no empty, '.' or '..' part between '/'s")
        if name in names:
            parser.error(f"--lora-modules: {name!r} is the base model's served name")
        if base is not None and base not in (*names, model):
            parser.error(f"--lora-modules: adapter {name!r} has base_model_name {base!r}, but this server's base "
                         f"model is {names[0]!r} (served names {list(names)}, --model {model!r})")
    return pairs


def prefix_caching(args: argparse.Namespace, parser: argparse.ArgumentParser) -> bool:
    """--no-prefix-caching and vLLM's --[no-]enable-prefix-caching: on unless one turns it off."""
    if args.enable_prefix_caching is not None and args.no_prefix_caching and args.enable_prefix_caching:
        parser.error("--enable-prefix-caching and --no-prefix-caching contradict each other")
    return not args.no_prefix_caching and args.enable_prefix_caching is not False


def vllm_engine_fields(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields set by the vLLM flags (the tokenizer and where the model comes from)."""
    return dict(chat_template=args.chat_template, tokenizer=args.tokenizer, revision=args.revision,
                download_dir=args.download_dir, trust_remote_code=args.trust_remote_code)


def check_tls(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The --ssl-* files load as uvicorn will load them, before the model does (a bad path is a start-up error in a
    second, not after the model's minutes)."""
    if args.ssl_certfile is None:
        for flag in ("ssl_keyfile", "ssl_ca_certs"):
            if getattr(args, flag) is not None:
                parser.error(f"--{flag.replace('_', '-')} needs --ssl-certfile")
        if args.ssl_cert_reqs:
            parser.error("--ssl-cert-reqs needs --ssl-certfile")
        return
    if args.ssl_cert_reqs and args.ssl_ca_certs is None:
        parser.error("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (the CAs client certificates are checked with)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        if args.ssl_ca_certs is not None:
            context.load_verify_locations(args.ssl_ca_certs)
    except (OSError, ssl.SSLError) as exc:
        parser.error(f"--ssl-certfile / --ssl-keyfile / --ssl-ca-certs: cannot load: {exc}")


def _response_role(value: str) -> str:
    if not value or len(value) > 64 or not value.isprintable():
        raise ValueError("a role name of 1-64 printable characters")
    return value


def _root_path(value: str) -> str:
    """`""`, or `/a/b`: no trailing slash, no query, fragment, space or non-ASCII character."""
    if value and (not value.startswith("/") or value.endswith("/") or not value.isascii() or
                  any(c in value for c in "?# \t\\") or not value.isprintable()):
        raise ValueError("a path prefix such as /llm (a leading slash, none at the end)")
    return value


def vllm_server_fields(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """ServerConfig fields set by the vLLM flags (besides the served names)."""
    if args.enable_chunked_prefill is False:
        parser.error("--no-enable-chunked-prefill: loraplex always chunks prefills (within "
                     "--max-num-batched-tokens); it cannot be turned off")
    if args.max_logprobs is not None and args.max_logprobs < -1:
        parser.error("--max-logprobs must be >= 0, or -1 for the whole vocabulary")
    check_tls(args, parser)
    return dict(generation_config=args.generation_config, override_generation_config=args.override_generation_config,
                tool_call_parser=args.tool_call_parser,
                reasoning_parser=args.reasoning_parser, log_requests=args.enable_log_requests,
                max_logprobs=args.max_logprobs, uvicorn_log_level=args.uvicorn_log_level,
                return_tokens_as_token_ids=args.return_tokens_as_token_ids, openapi=not args.disable_fastapi_docs,
                allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs,
                ssl_cert_reqs=args.ssl_cert_reqs, root_path=args.root_path, response_role=args.response_role,
                force_include_usage=args.enable_force_include_usage,
                access_log=not (args.no_access_log or args.disable_uvicorn_access_log))
