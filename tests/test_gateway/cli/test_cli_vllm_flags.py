"""vLLM's `serve` flags through the real parser (gateway/cli.py + gateway/server/cli_vllm.py): what each one sets,
and the clear errors for what loraplex cannot do. The servers that prove their meaning end to end:
tests/test_gateway/api/test_server_vllm_compat.py."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from testlib import CHAT_TEMPLATES

from gateway.cli import build_parser, config_from_args
from gateway.server.config import ServerConfig
from gateway.inputs.params import chat_sampling_params, completion_sampling_params
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.inputs.sampling_defaults import RequestDefaults, load_request_defaults
from gateway.tools.tools import plan_tools
from grammar.schema.lowering import SchemaOptions

TEMPLATES = CHAT_TEMPLATES


def parse(*argv: str) -> ServerConfig:
    parser = build_parser()
    return config_from_args(parser.parse_args(["serve", *argv]), parser)


def parse_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_a_vllm_launch_line_parses(tmp_path: Path) -> None:
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text('{"temperature": 0.6}')
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    cfg = parse("org/model", "--enable-lora", "--lora-modules", "a=/p/a",
                '{"name": "b", "path": "/p/b", "base_model_name": "org/model"}',
                "--chat-template", str(template), "--generation-config", str(gen),
                "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json", "--disable-log-requests",
                "--enable-log-requests", "--disable-uvicorn-access-log", "--disable-log-stats",
                "--uvicorn-log-level", "info", "-tp", "2", "--enable-chunked-prefill", "--kv-cache-dtype", "auto",
                "--swap-space", "4", "--trust-remote-code", "--enable-prefix-caching",
                "--served-model-name", "m1", "m2", "--max-logprobs", "40", "--tokenizer", "org/tok",
                "--revision", "v2", "--download-dir", str(tmp_path), "--max-lora-rank", "16",
                "--return-tokens-as-token-ids", "--override-generation-config", '{"temperature": 0.5}',
                "--allowed-origins", '["https://a.example"]', "--allowed-methods", '["GET", "POST"]',
                "--allowed-headers", '["authorization"]', "--allow-credentials", "--tokenizer-mode", "auto",
                "--lora-dtype", "auto", "--disable-fastapi-docs", "--root-path", "/llm/v1x",
                "--response-role", "model", "--enable-force-include-usage", "--enable-server-load-tracking",
                "--enable-prompt-tokens-details", "--enable-request-id-headers", "--max-log-len", "100",
                "--disable-frontend-multiprocessing")
    eng = cfg.engine
    assert eng.model == "org/model" and cfg.served_model_names == ("m1", "m2")
    assert cfg.served_model_name == "m1" and cfg.served_model_aliases == ("m2",)
    assert eng.lora.lora_modules == (("a", "/p/a"), ("b", "/p/b"))
    assert eng.chat_template == template.read_text() and cfg.generation_config == str(gen)
    assert cfg.tool_call_parser == "llama3_json" and cfg.log_requests and not cfg.access_log
    assert cfg.uvicorn_log_level == "info" and eng.parallel.tensor_parallel_size == 2
    assert eng.cache.enable_prefix_caching
    assert eng.trust_remote_code and cfg.max_logprobs == 40 and eng.lora.max_lora_rank == 16
    assert (eng.tokenizer, eng.revision, eng.download_dir) == ("org/tok", "v2", str(tmp_path))
    assert cfg.return_tokens_as_token_ids and cfg.override_generation_config == (("temperature", 0.5),)
    assert (cfg.allowed_origins, cfg.allowed_methods, cfg.allowed_headers, cfg.allow_credentials) == \
        (("https://a.example",), ("GET", "POST"), ("authorization",), True)
    assert not cfg.openapi and cfg.root_path == "/llm/v1x" and cfg.response_role == "model"
    assert cfg.force_include_usage and not cfg.engine_process


def test_defaults_keep_loraplex_behaviour() -> None:
    cfg = parse("--model", "/m")
    eng = cfg.engine
    assert cfg.served_model_names == ("/m",) and cfg.generation_config == "auto" and cfg.tool_call_parser is None
    assert eng.chat_template is None and cfg.max_logprobs is None and not cfg.log_requests and cfg.access_log
    assert eng.cache.enable_prefix_caching and cfg.uvicorn_log_level is None and not eng.trust_remote_code
    assert not cfg.return_tokens_as_token_ids and cfg.allowed_origins == () and not cfg.allow_credentials
    assert cfg.openapi and cfg.root_path == "" and cfg.response_role == "assistant" and not cfg.force_include_usage
    assert (eng.tokenizer, eng.revision, eng.download_dir) == (None, None, None)


def test_positional_model_and_model_flag() -> None:
    assert parse("/a").engine.model == "/a" and parse("/a").served_model_name == "/a"
    assert parse("/a", "--model", "/a").engine.model == "/a"
    assert parse("--model", "/a").engine.model == "/a"


def test_prefix_caching_spellings() -> None:
    assert not parse("--no-enable-prefix-caching").engine.cache.enable_prefix_caching
    assert not parse("--no-prefix-caching").engine.cache.enable_prefix_caching
    assert parse("--enable-prefix-caching").engine.cache.enable_prefix_caching


def test_chat_template_as_text() -> None:
    cfg = parse("--chat-template", "{% for m in messages %}{{ m.content }}\\n{% endfor %}")
    assert cfg.engine.chat_template == "{% for m in messages %}{{ m.content }}\n{% endfor %}"   # escapes decoded
    training = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert parse("--chat-template", training).engine.chat_template == training   # transformers' own extensions


@pytest.mark.parametrize("argv,needle", [
    (["/a", "--model", "/b"], "differ"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype"),
    (["--tool-call-parser", "pythonic"], "hermes, llama3_json, llama4_json"),
    (["--no-enable-chunked-prefill"], "always chunks"),
    (["--enable-prefix-caching", "--no-prefix-caching"], "contradict"),
    (["--generation-config", "/no/such/dir"], "--generation-config"),
    (["--chat-template", "/no/such/template.jinja"], "looks like a file path"),
    (["--chat-template", "{% for m in messages %}"], "not a valid Jinja template"),
    (["--max-logprobs", "-2"], "--max-logprobs"),
    (["--override-generation-config", "temperature=0.5"], "not JSON"),
    (["--override-generation-config", "[1]"], "expected a JSON object"),
    (["--allowed-origins", "*"], "not JSON"),
    (["--tokenizer-mode", "mistral"], "HF fast tokenizer"),
    (["--lora-dtype", "float16"], "adapters take the model's dtype"),
    (["--allowed-origins", '"*"'], "expected a JSON list"),
    (["--swap-space", "-1"], "--swap-space"),
    (["--lora-modules", '{"name": "a"}'], "--lora-modules"),
    (["--lora-modules", '{"name": "a", "path": "/p", "rank": 4}'], "unknown keys"),
    (["--lora-modules", "{not json"], "not valid JSON"),
    (["--model", "/m", "--lora-modules", '{"name": "a", "path": "/p", "base_model_name": "other"}'], "other"),
    (["--model", "/m", "--lora-modules", "a=/p", '{"name": "a", "path": "/q"}'], "duplicate"),
    (["--served-model-name", "x", "x"], "distinct"),
    (["--served-model-name", "x", "--lora-modules", "x=/p"], "base model's served name"),
    (["--lora-modules", "../up=/p"], "bad adapter name"),         # refused before the model loads, not after
    (["--lora-modules", '{"name": "a/./b", "path": "/p"}'], "bad adapter name"),
    (["--enable-expert-parallel"], "unrecognized arguments"),
])
def test_refusals_are_clear(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert needle in parse_error(capsys, *argv)


def test_base_model_name_may_name_a_served_name_or_the_model() -> None:
    for base in ("alias", "/m"):
        cfg = parse("--model", "/m", "--served-model-name", "first", "alias", "--lora-modules",
                    json.dumps({"name": "a", "path": "/p", "base_model_name": base}))
        assert cfg.engine.lora.lora_modules == (("a", "/p"),)


# -- what the flags change about requests (the gateway's side; servers prove it end to end) -------------------
def test_generation_config_modes(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
         "repetition_penalty": 1.1, "max_new_tokens": 64, "do_sample": True}))
    auto = load_request_defaults("auto", tmp_path, None, 1000)
    assert dict(auto.sampling) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                   "repetition_penalty": 1.1, "max_tokens": 64}
    assert load_request_defaults(str(tmp_path), Path("/elsewhere"), None, 1000).sampling == auto.sampling
    assert load_request_defaults("vllm", tmp_path, None, 1000).sampling == ()
    assert load_request_defaults("auto", tmp_path / "gen-less", None, 1000).sampling == ()  # no file: none
    assert load_request_defaults("vllm", tmp_path, -1, 1000).max_logprobs == 1000        # -1: the vocabulary
    assert load_request_defaults("vllm", tmp_path, 5000, 1000).max_logprobs == 1000
    # --override-generation-config: over the file's key by key (null removes one), alone with vllm
    over = load_request_defaults("auto", tmp_path, None, 1000, overrides={"temperature": 0.2, "top_k": None})
    assert dict(over.sampling) == {"temperature": 0.2, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1,
                                   "max_tokens": 64}
    assert over.source == f"{tmp_path / 'generation_config.json'} and --override-generation-config"
    alone = load_request_defaults("vllm", tmp_path, None, 1000, overrides={"max_new_tokens": 7})
    assert dict(alone.sampling) == {"max_tokens": 7} and alone.source == "--override-generation-config"
    with pytest.raises(ValueError, match="unknown key.*temprature"):
        load_request_defaults("auto", tmp_path, None, 1000, overrides={"temprature": 0.2})
    with pytest.raises(ValueError, match="--override-generation-config.*top_p"):
        load_request_defaults("vllm", tmp_path, None, 1000, overrides={"top_p": 2})
    # --return-tokens-as-token-ids: off unless given, whichever way the defaults were found (a file or none)
    for mode, folder in (("auto", tmp_path), ("auto", tmp_path / "gen-less"), ("vllm", tmp_path)):
        assert not load_request_defaults(mode, folder, None, 1000).tokens_as_token_ids
        on = load_request_defaults(mode, folder, None, 1000, True)
        assert on.tokens_as_token_ids and on.source in (None, str(tmp_path / "generation_config.json"))
    (tmp_path / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ValueError, match="temperature"):
        load_request_defaults("auto", tmp_path, None, 1000)
    (tmp_path / "generation_config.json").write_text('{"top_k": 2.5}')
    with pytest.raises(ValueError, match="top_k"):
        load_request_defaults("auto", tmp_path, None, 1000)


def test_defaults_fill_only_omitted_fields() -> None:
    defaults = RequestDefaults((("temperature", 0.6), ("top_k", 20), ("repetition_penalty", 1.1), ("max_tokens", 9)))
    omitted = chat_sampling_params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]), defaults)
    assert (omitted.temperature, omitted.top_k, omitted.repetition_penalty, omitted.max_tokens) == (0.6, 20, 1.1, 9)
    explicit = completion_sampling_params(CompletionRequest(prompt="x", temperature=0.0, top_k=0, max_tokens=3,
                                                            repetition_penalty=1.0), defaults)
    assert (explicit.temperature, explicit.top_k, explicit.repetition_penalty, explicit.max_tokens) == (0, 0, 1, 3)
    assert completion_sampling_params(CompletionRequest(prompt="x", max_completion_tokens=4), defaults).max_tokens == 4
    plain = completion_sampling_params(CompletionRequest(prompt="x"))   # no defaults: as before
    assert (plain.temperature, plain.top_k, plain.max_tokens) == (1.0, 0, None)


def test_default_max_tokens_fits_the_context() -> None:
    defaults = RequestDefaults((("max_tokens", 50),))
    ctx64 = 64   # max_model_len
    body = CompletionRequest(prompt="x")
    params = completion_sampling_params(body, defaults)
    assert defaults.fit_context(params, body, [[1] * 10], ctx64).max_tokens == 50
    assert defaults.fit_context(params, body, [[1] * 10, [1] * 30], ctx64).max_tokens == 34   # the longest prompt
    explicit = CompletionRequest(prompt="x", max_tokens=60)
    assert defaults.fit_context(completion_sampling_params(explicit, defaults), explicit, [[1] * 30], ctx64).max_tokens \
        == 60   # an explicit value is the client's: too long is its 400


@pytest.mark.parametrize("cap,completion_ok,chat_ok", [(None, 5, 20), (40, 40, 40), (3, 3, 3)])
def test_max_logprobs_cap(cap: int | None, completion_ok: int, chat_ok: int) -> None:
    from gateway.errors import APIError

    defaults = RequestDefaults(max_logprobs=cap)
    assert completion_sampling_params(CompletionRequest(prompt="x", logprobs=completion_ok), defaults).logprobs \
        == completion_ok
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True}
    assert chat_sampling_params(ChatCompletionRequest(**chat, top_logprobs=chat_ok), defaults).logprobs == chat_ok
    with pytest.raises(APIError) as info:
        completion_sampling_params(CompletionRequest(prompt="x", logprobs=completion_ok + 1), defaults)
    assert info.value.param == "logprobs" and "--max-logprobs" in info.value.message
    with pytest.raises(APIError) as info:
        chat_sampling_params(ChatCompletionRequest(**chat, top_logprobs=chat_ok + 1), defaults)
    assert info.value.param == "top_logprobs"


def test_tool_call_parser_overrides_the_template() -> None:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tool_choice="required",
                                 tools=[{"type": "function", "function": {"name": "f"}}])
    hermes = SimpleNamespace(chat_template=(TEMPLATES / "hermes_qwen.jinja").read_text())
    llama = SimpleNamespace(chat_template=(TEMPLATES / "llama31_json.jinja").read_text())
    plain = SimpleNamespace(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    options = SchemaOptions()
    fam = lambda tok, parser=None: plan_tools(body, tok, options, parser).fmt.family   # noqa: E731
    assert (fam(hermes), fam(llama), fam(plain)) == ("hermes", "llama3_json", "hermes")
    assert fam(hermes, "llama3_json") == "llama3_json" and fam(llama, "hermes") == "hermes"
    assert fam(plain, "llama4_json") == "llama3_json"
    mistral = SimpleNamespace(chat_template=(TEMPLATES / "mistral_v03_tools.jinja").read_text())
    assert fam(mistral) == "mistral" and fam(hermes, "mistral") == "mistral" and fam(mistral, "hermes") == "hermes"
    phi4 = SimpleNamespace(chat_template=(TEMPLATES / "phi4_mini_functools.jinja").read_text())
    assert fam(phi4) == "phi4_mini_json" and fam(hermes, "phi4_mini_json") == "phi4_mini_json"


# -- hub ids, remote code, aliases, the engine's logprobs bound ------------------------------------------------
def test_hub_revision_and_download_dir_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from core.models.loader import resolve_model_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = tmp_path / "models--org--m"
    for ref, commit in (("main", "a" * 40), ("v2", "b" * 40)):
        (base / "refs").mkdir(parents=True, exist_ok=True)
        (base / "refs" / ref).write_text(commit)
        (base / "snapshots" / commit).mkdir(parents=True)
        (base / "snapshots" / commit / "config.json").write_text("{}")
    assert resolve_model_path("org/m", None, str(tmp_path)).name == "a" * 40
    assert resolve_model_path("org/m", "v2", str(tmp_path)).name == "b" * 40
    assert resolve_model_path("org/m", "b" * 40, str(tmp_path)).name == "b" * 40
    with pytest.raises(FileNotFoundError, match="revision v3.*HF_HUB_OFFLINE=1"):
        resolve_model_path("org/m", "v3", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not in the HF cache"):
        resolve_model_path("org/other", None, str(tmp_path))


def test_custom_modelling_code_is_a_clear_start_up_error(tmp_path: Path) -> None:
    from core.config import EngineConfig
    from core.engine.setup import resolve_model_files

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "deepthing", "architectures": ["DeepThingForCausalLM"],
        "auto_map": {"AutoModelForCausalLM": "modeling_deepthing.DeepThingForCausalLM"}}))
    with pytest.raises(ValueError, match="custom modelling code.*--trust-remote-code.*'deepthing'.*llama"):
        resolve_model_files(EngineConfig(model=str(tmp_path), trust_remote_code=True))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ValueError, match="'mamba'") as info:
        resolve_model_files(EngineConfig(model=str(tmp_path)))
    assert "custom" not in str(info.value)


def test_aliases_name_the_base_for_tenants_too() -> None:
    from gateway.errors import APIError
    from gateway.inputs.models import ServedModels

    models = ServedModels("a", root="/m", aliases=("b",))
    assert models.resolve("b").name == "a" and models.resolve(None).name == "a"
    assert [c["id"] for c in models.cards()] == ["a", "b"]
    only_b = frozenset({"b"})       # a tenant allowed one name of the base may use every name of it
    assert models.resolve("a", only_b).name == "a" and [c["id"] for c in models.cards(only_b)] == ["a", "b"]
    with pytest.raises(APIError) as info:
        models.resolve("a", frozenset({"adapter-x"}))
    assert info.value.status == 404


def test_engine_bounds_logprobs_by_the_vocabulary() -> None:
    from core.scheduling.admission import check_request
    from core.errors import RequestRejected
    from core.sampling.params import SamplingParams

    assert check_request(4, SamplingParams(max_tokens=2, logprobs=100), 64, 100, 16, 8) == 2
    with pytest.raises(RequestRejected) as info:
        check_request(4, SamplingParams(max_tokens=2, logprobs=101), 64, 100, 16, 8)
    assert info.value.param == "logprobs"
    with pytest.raises(ValueError):
        SamplingParams(logprobs=-1)


def test_default_max_tokens_fits_the_kv_pool_too(tmp_path: Path) -> None:
    """A generation_config.json `max_new_tokens` the request did not send shrinks to what the whole KV pool
    holds when a small --kv-cache-memory holds less than the context (it reached the engine as is: a 400 'needs
    N KV blocks' for a value the client never sent). The stand-in engine: 64 blocks of 16 = 1024 tokens."""
    from starlette.testclient import TestClient
    from transformers import AutoTokenizer

    from core.config import EngineConfig
    from core.errors import RequestRejected
    from fake_engine import FakeEngine
    from gateway.app import build_app
    from gateway.inputs.models import ServedModels
    from gateway.inputs.prompts import PromptEncoder
    from gateway.observability.metrics import GatewayMetrics
    from gateway.outputs.responses import TokenTexts
    from gateway.server.state import GatewayState
    from tiny_models import build_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(build_tokenizer(tmp_path / "tok")))
    seen: list[tuple[int, int | None]] = []

    def record(num_tokens: int, params: object) -> int:
        seen.append((num_tokens, params.max_tokens))   # type: ignore[attr-defined]
        raise RequestRejected("recorded", "stop_here", "prompt")

    engine = FakeEngine(tokenizer, max_model_len=4096, check_request=record)
    pool = engine.facts.num_kv_blocks * engine.facts.block_size
    config = ServerConfig(engine=EngineConfig(model="/models/base"), served_model_name="base")
    state = GatewayState(config=config, aeng=engine, models=ServedModels("base", "/models/base"),
                         encoder=PromptEncoder(tokenizer, len(tokenizer), 4096), texts=TokenTexts(tokenizer),
                         metrics=GatewayMetrics(engine, max_loras=8),
                         defaults=RequestDefaults((("max_tokens", 3000),)))
    client = TestClient(build_app(state))
    for max_tokens in (None, 3000):
        body = {"model": "base", "prompt": "def f(x):"}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        assert client.post("/v1/completions", json=body).json()["error"]["code"] == "stop_here"
    (prompt_len, defaulted), (_, explicit) = seen
    assert defaulted == pool - prompt_len      # the default, fitted to the pool
    assert explicit == 3000                    # the client's own value is the client's: the engine's 400


@pytest.mark.parametrize("prefix", ["llm", "/llm/", "/l m", "/llm?x=1", "/ünï"])
def test_root_path_must_be_a_path_prefix(prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--model", "/m", "--root-path", prefix)
    assert "--root-path" in capsys.readouterr().err


def test_disable_frontend_multiprocessing_contradicts_engine_process_on(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--model", "/m", "--engine-process", "on", "--disable-frontend-multiprocessing")
    assert "--disable-frontend-multiprocessing" in capsys.readouterr().err
    assert not parse("--model", "/m", "--engine-process", "off", "--disable-frontend-multiprocessing").engine_process
