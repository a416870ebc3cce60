"""vLLM's `stop_reason` and stop-token text over HTTP, against one `loraplex serve` of a tiny model scripted to
write "alpha beta gamma delta eps zeta" then EOS (tests/helpers/scripted_model.py): /v1/completions and
/v1/chat/completions, streamed and not, through httpx and the stock `openai` client. The offline side:
tests/test_core/sampling/test_stop_semantics.py."""
from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest

openai = pytest.importorskip("openai")

from gateway_server import ServerProcess  # noqa: E402
from scripted_model import scripted_model  # noqa: E402

PIECES = ["alpha", "beta", "gamma", "delta", "eps", "zeta"]
USER = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(scripted_model(tmp_path_factory.mktemp("stop_reason"), [*PIECES, "</s>"]),
                         "--max-model-len", "256", "--served-model-name", "tiny")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def gamma(http: httpx.Client) -> int:
    resp = http.post("/tokenize", json={"model": "tiny", "prompt": "gamma", "add_special_tokens": False})
    ids = resp.json()["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


def answer(http: httpx.Client, path: str, **body: Any) -> tuple[str, str, Any]:
    """(text, finish_reason, stop_reason) of the single choice, collected or read from the stream."""
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, **body}
    if "messages" not in body:
        body["prompt"] = "x"
    if not body.get("stream"):
        resp = http.post(path, json=body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        return text, choice["finish_reason"], choice["stop_reason"]
    text, finish, stop_reason = "", None, None
    with http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                text += choice["text"] if "text" in choice else choice["delta"].get("content", "")
                if choice["finish_reason"] is not None:
                    finish, stop_reason = choice["finish_reason"], choice["stop_reason"]
                else:
                    assert choice.get("stop_reason") is None
    return text, finish, stop_reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,extra", [("/v1/completions", {}), ("/v1/chat/completions", {"messages": USER})])
def test_stop_reason_and_the_stop_tokens_text(http: httpx.Client, gamma: int, path: str, extra: dict[str, Any],
                                              stream: bool) -> None:
    def ask(**body: Any) -> tuple[str, str, Any]:
        return answer(http, path, stream=stream, **extra, **body)
    everything = "".join(PIECES)
    assert ask() == (everything, "stop", None)                            # the tokenizer's EOS
    assert ask(max_tokens=2) == ("alphabeta", "length", None)
    assert ask(stop=["zz", "mmad"]) == ("alphabetaga", "stop", "mmad")
    assert ask(stop="mmad", include_stop_str_in_output=True) == ("alphabetagammad", "stop", "mmad")
    # the stop token's own text was in the answer ("alphabetagamma"); vLLM leaves it out unless asked
    assert ask(stop_token_ids=[gamma]) == ("alphabeta", "stop", gamma)
    assert ask(stop_token_ids=[gamma], include_stop_str_in_output=True) == ("alphabetagamma", "stop", gamma)
    # and the EOS's, shown with skip_special_tokens false
    assert ask(skip_special_tokens=False) == (everything, "stop", None)
    # a stop string within min_tokens ended the answer there; vLLM does not look for one
    assert ask(stop=["beta"], min_tokens=3) == (everything, "stop", None)


def test_usage_counts_the_stop_token(http: httpx.Client, gamma: int) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 8, "temperature": 0, "stop_token_ids": [gamma]}
    assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 3


def test_the_openai_client_reads_stop_reason(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(model="tiny", prompt="x", max_tokens=8, temperature=0, stop=["delta"])
    assert out.choices[0].text == "alphabetagamma" and out.choices[0].model_extra["stop_reason"] == "delta"
    chat = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0, stop="eps")
    assert chat.choices[0].message.content == "alphabetagammadelta"
    assert chat.choices[0].model_extra["stop_reason"] == "eps"
