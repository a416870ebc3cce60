"""vLLM launch lines against real `loraplex serve` subprocesses: what each flag means, end to end.

Two starts cover every flag (tests/test_gateway/cli/test_cli_vllm_flags.py parses them one by one):
- `hub`: a hub id from a local HF cache (`--download-dir`, `HF_HUB_OFFLINE=1`) at `--revision v2`, whose
  snapshot has no tokenizer (a hub `--tokenizer` must supply it) and whose generation_config.json carries
  sampling defaults (`--generation-config auto`, the default); `--served-model-name a b`, `--max-logprobs`,
  `--tool-call-parser`, and the flags accepted as no-ops.
- `local`: a positional model dir with `--chat-template`, `--generation-config vllm` with `--override-generation-config`, `--enable-log-requests`
  and `--disable-uvicorn-access-log`.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from testlib import CHAT_TEMPLATES

from gateway_server import ServerProcess, tiny_model

TEMPLATES = CHAT_TEMPLATES
MAIN, V2, TOK = "a" * 40, "b" * 40, "c" * 40
DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "top_k": 1, "max_new_tokens": 7}   # the v2 snapshot's
PROMPT = "def f(x):\n    return x"
TOOL = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
    "additionalProperties": False}}}]
USER = [{"role": "user", "content": "Add."}]


def hf_repo(cache: Path, repo_id: str, refs: dict[str, tuple[str, dict[str, Any]]]) -> None:
    """The HF cache layout: models--org--name/refs/<ref> (a commit) and snapshots/<commit>/files."""
    base = cache / ("models--" + repo_id.replace("/", "--"))
    (base / "refs").mkdir(parents=True, exist_ok=True)
    for ref, (commit, files) in refs.items():
        (base / "refs" / ref).write_text(commit)
        snap = base / "snapshots" / commit
        snap.mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            if isinstance(content, Path):
                shutil.copy(content, snap / name)
            else:
                (snap / name).write_text(content)


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("vllm_src"))


@pytest.fixture(scope="module")
def hub(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    cache = tmp_path_factory.mktemp("hf_cache")
    weights = {name: src / name for name in ("config.json", "model.safetensors", "generation_config.json")}
    gen = {**json.loads((src / "generation_config.json").read_text()), **DEFAULTS}
    hf_repo(cache, "org/tiny", {"main": (MAIN, weights),
                                "v2": (V2, {**weights, "generation_config.json": json.dumps(gen)})})
    tok_config = json.loads((src / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = (TEMPLATES / "hermes_qwen.jinja").read_text()
    hf_repo(cache, "org/tok", {"main": (TOK, {"tokenizer.json": src / "tokenizer.json",
                                              "special_tokens_map.json": src / "special_tokens_map.json",
                                              "tokenizer_config.json": json.dumps(tok_config)})})
    proc = ServerProcess(Path("org/tiny"), "org/tiny", "--revision", "v2", "--download-dir", str(cache),
                         "--tokenizer", "org/tok", "--served-model-name", "a", "b", "--max-logprobs", "30",
                         "--tool-call-parser", "llama3_json", "--enable-auto-tool-choice", "--enable-lora",
                         "--disable-log-requests", "--disable-log-stats", "-tp", "1", "--enable-chunked-prefill",
                         "--kv-cache-dtype", "auto", "--swap-space", "4", "--trust-remote-code",
                         "--enable-prefix-caching", "--max-model-len", "1024")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def local(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = tmp_path_factory.mktemp("vllm_local") / "m"
    shutil.copytree(src, model)
    gen = {**json.loads((src / "generation_config.json").read_text()), "top_k": 1, "max_new_tokens": 3}
    (model / "generation_config.json").write_text(json.dumps(gen))   # ignored: --generation-config vllm
    proc = ServerProcess(model, str(model), "--chat-template", str(TEMPLATES / "llama31_json.jinja"),
                         "--generation-config", "vllm", "--enable-log-requests", "--disable-uvicorn-access-log",
                         "--uvicorn-log-level", "info", "--max-model-len", "1024",
                         "--override-generation-config", '{"max_new_tokens": 5}')
    yield proc
    proc.stop()


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def completion(server: ServerProcess, **fields: Any) -> dict[str, Any]:
    r = post(server, "/v1/completions", {"prompt": PROMPT, "ignore_eos": True, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_generation_config_defaults_act_as_the_explicit_fields(hub: ServerProcess) -> None:
    """The v2 snapshot's defaults (top_k 1, so greedy whatever the seed; 7 tokens) apply to a request that
    omits them exactly as the same explicit fields do; main's snapshot has none, so this also proves
    --revision."""
    implicit = completion(hub, seed=5)
    assert implicit["usage"]["completion_tokens"] == 7
    explicit = completion(hub, seed=5, temperature=0.8, top_p=0.95, top_k=1, max_tokens=7)
    assert implicit["choices"][0]["text"] == explicit["choices"][0]["text"]
    assert implicit["choices"][0]["text"] == completion(hub, temperature=0, max_tokens=7)["choices"][0]["text"]
    sampled = completion(hub, seed=5, top_k=0, max_tokens=7)   # an explicit field wins over the default
    assert sampled["choices"][0]["text"] != implicit["choices"][0]["text"]
    assert completion(hub, max_tokens=3)["usage"]["completion_tokens"] == 3


def test_generation_config_vllm_ignores_the_file(local: ServerProcess) -> None:
    """The model's file says top_k 1 and 3 tokens; `vllm` applies neither, only --override-generation-config's
    5 tokens."""
    assert completion(local, seed=5)["usage"]["completion_tokens"] == 5
    plain = completion(local, seed=5, max_tokens=7)
    assert plain["usage"]["completion_tokens"] == 7
    assert plain["choices"][0]["text"] == completion(local, seed=5, max_tokens=7, top_k=0)["choices"][0]["text"]
    assert plain["choices"][0]["text"] != completion(local, seed=5, max_tokens=7, top_k=1)["choices"][0]["text"]


def test_served_model_aliases(hub: ServerProcess) -> None:
    ids = [m["id"] for m in httpx.get(f"{hub.url}/v1/models").json()["data"]]
    assert ids == ["a", "b"]   # vLLM lists every served name
    for name in ("a", "b", None):
        out = completion(hub, model=name, max_tokens=2)
        assert out["model"] == "a"   # answers carry the first name, as vLLM
    assert post(hub, "/v1/completions", {"model": "c", "prompt": "x"}).status_code == 404


def test_max_logprobs_raises_the_cap(hub: ServerProcess) -> None:
    out = completion(hub, max_tokens=1, logprobs=30)   # 5 without the flag
    assert len(out["choices"][0]["logprobs"]["top_logprobs"][0]) > 5   # a dict by text: equal texts merge
    r = post(hub, "/v1/chat/completions", {"messages": USER, "max_tokens": 1, "logprobs": True, "top_logprobs": 25})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 25
    r = post(hub, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": 31})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def raw_tool_text(server: ServerProcess) -> str:
    """What the model wrote for a required tool call (joined from the logprobs' tokens)."""
    r = post(server, "/v1/chat/completions", {"messages": USER, "tools": TOOL, "tool_choice": "required",
                                              "max_tokens": 40, "logprobs": True, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "add"
    return "".join(t["token"] for t in choice["logprobs"]["content"])


# a Llama 3.x JSON call in any of the family's forms (grammar/specs/tool_calls.py), never Hermes' <tool_call>
LLAMA_CALL = re.compile(r'\{"(type": "function", ")?name": "add", "(parameters|arguments)": ')


def test_tool_call_parser_overrides_the_templates_family(hub: ServerProcess) -> None:
    # the hub tokenizer's template is Hermes (<tool_call>); --tool-call-parser llama3_json wins
    assert LLAMA_CALL.match(raw_tool_text(hub))


def test_chat_template_replaces_the_tokenizers(local: ServerProcess, src: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    template = (TEMPLATES / "llama31_json.jinja").read_text()
    r = post(local, "/tokenize", {"messages": USER})
    assert r.status_code == 200
    expected = tok.apply_chat_template(USER, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert r.json()["tokens"] == tok.encode(expected, add_special_tokens=False)
    assert r.json()["tokens"] != tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)
    # tool calls follow the new template's family (Llama 3.1 JSON), not the tokenizer's own template
    assert LLAMA_CALL.match(raw_tool_text(local))


def test_hub_tokenizer_is_used(hub: ServerProcess, src: Path) -> None:
    """The model's snapshot has no tokenizer files: the server runs on org/tok's, with its Hermes template."""
    r = post(hub, "/tokenize", {"messages": USER})
    assert r.status_code == 200
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    text = tok.apply_chat_template(USER, chat_template=(TEMPLATES / "hermes_qwen.jinja").read_text(),
                                   tokenize=False, add_generation_prompt=True)
    assert r.json()["tokens"] == tok.encode(text, add_special_tokens=False)


def test_request_log_has_parameters_not_text(local: ServerProcess) -> None:
    completion(local, max_tokens=2, prompt="SECRET-PROMPT-TEXT", temperature=0.5, seed=11)
    out = local.output()
    lines = [line for line in out.splitlines() if "loraplex.requests" in line and "request cmpl-" in line]
    assert lines and "'temperature': 0.5" in lines[-1] and "'seed': 11" in lines[-1]
    assert "SECRET-PROMPT-TEXT" not in out
    assert '"path":"/v1/completions"' not in out   # --disable-uvicorn-access-log: no access-log lines
