"""What an app written against the stock `openai` SDK does, against one real `loraplex serve` (tiny random Llama,
CPU, a Hermes/Qwen2.5 chat template): an answer's message sent back as history, tool calls cut at max_tokens
(the same streamed or not), typed errors, stream indexes and the usage chunk, the async client, and a stream
the client leaves freeing the server. Neighbours: test_server_openai.py (basics), test_server_tools.py (tools)."""
from __future__ import annotations

import asyncio
import json
import time
import warnings
from typing import Any, Iterator

import httpx
import pytest

from testlib import CHAT_TEMPLATES

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from gateway_server import ServerProcess, model_with_chat_template  # noqa: E402
from tool_streams import call_pairs, stream_tool_calls  # noqa: E402

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
DIGIT = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["a"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "pick", "parameters": DIGIT}}]


class Digit(pydantic.BaseModel):
    a: int = pydantic.Field(ge=0, le=9)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = model_with_chat_template(tmp_path_factory.mktemp("sdk"), CHAT_TEMPLATES / "hermes_qwen.jinja")
    proc = ServerProcess(path, "--max-model-len", "1024", "--served-model-name", "tiny")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_answer_message_goes_back_as_history(client: "openai.OpenAI") -> None:
    """`messages.append(completion.choices[0].message)` (the SDK's own pattern for tool calls) sends every field
    the answer carried: `refusal: null` (and `parsed` after `parse`) were 400 unknown fields."""
    plain = client.chat.completions.create(model="tiny", messages=USER, max_tokens=3, temperature=0)
    history: list[Any] = [*USER, plain.choices[0].message, {"role": "user", "content": "and tomorrow?"}]
    assert client.chat.completions.create(model="tiny", messages=history, max_tokens=2).choices

    called = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                            max_tokens=120, temperature=0)
    msg = called.choices[0].message
    assert called.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    history = [*USER, msg, *({"role": "tool", "tool_call_id": c.id, "content": "21"} for c in msg.tool_calls)]
    assert client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=2).choices

    parsed = client.chat.completions.parse(model="tiny", messages=USER, response_format=Digit, max_tokens=60,
                                           temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Digit)
    with warnings.catch_warnings():   # pydantic's serializer warning about the SDK's `parsed` field, not ours
        warnings.simplefilter("ignore")
        history = [*USER, parsed.choices[0].message, {"role": "user", "content": "again"}]
        assert client.chat.completions.create(model="tiny", messages=history, max_tokens=2).choices


def test_refusal_and_reasoning_of_an_assistant_turn(client: "openai.OpenAI") -> None:
    def prompt_tokens(assistant: dict[str, Any]) -> int:
        out = client.chat.completions.create(model="tiny", messages=[*USER, assistant, *USER], max_tokens=1)
        return out.usage.prompt_tokens

    said = prompt_tokens({"role": "assistant", "content": "I cannot help with that."})
    assert prompt_tokens({"role": "assistant", "content": None, "refusal": "I cannot help with that."}) == said
    assert prompt_tokens({"role": "assistant", "content": "I cannot help with that.", "refusal": None,
                          "reasoning_content": None, "function_call": None, "audio": None,
                          "annotations": []}) == said
    # this template has no place for reasoning: it drops it (Qwen3's renders it for the turns after the last query)
    assert prompt_tokens({"role": "assistant", "content": "I cannot help with that.",
                          "reasoning_content": "The user asks about weather."}) == said
    for message, param in [({"role": "user", "content": "x", "refusal": "no"}, "messages.0"),
                           ({"role": "assistant", "content": "x", "refusal": "no"}, "messages.0"),
                           ({"role": "assistant", "content": "x", "function_call": {"name": "f"}},
                            "messages.0.function_call")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=[message, *USER], max_tokens=1)
        assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"


def test_tool_call_cut_at_max_tokens_is_the_same_streamed_or_not(client: "openai.OpenAI") -> None:
    """A call cut by max_tokens: the stream had sent the call's name (and some arguments) while the answer
    without stream gave no `tool_calls` and the raw call markup as `content`. Both now give the cut call with the
    arguments written so far and finish_reason "length", as OpenAI does."""
    kwargs = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", temperature=0)
    whole = client.chat.completions.create(max_tokens=120, **kwargs)
    assert whole.choices[0].finish_reason == "tool_calls"
    need = whole.usage.completion_tokens
    args = whole.choices[0].message.tool_calls[0].function.arguments
    num_cut_calls = 0
    for max_tokens in (need - 1, need - 4, need - 8, need // 2, 3):
        out = client.chat.completions.create(max_tokens=max_tokens, **kwargs).choices[0]
        assert out.finish_reason == "length"
        calls = [(c.function.name, c.function.arguments) for c in out.message.tool_calls or []]
        content, streamed, finish = stream_tool_calls(client, max_tokens=max_tokens, **kwargs)
        assert (finish, call_pairs(streamed), content) == ("length", calls, out.message.content or ""), max_tokens
        assert "<tool_call>" not in (out.message.content or "")
        for name, cut in calls:
            assert name == "pick" and args.startswith(cut.rstrip())
        num_cut_calls += bool(calls)
    assert num_cut_calls >= 2


def test_errors_are_the_sdk_typed_exceptions(client: "openai.OpenAI") -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body == {"message": "The model `no-such-model` does not exist.", "type": "not_found_error",
                                  "param": "model", "code": "model_not_found"}
    assert client.models.retrieve("tiny").id == "tiny"
    bad = [dict(top_logprobs=2), dict(n=0), dict(response_format={"type": "bogus"}),
           dict(stream_options={"include_usage": True}), dict(max_tokens=5000)]
    for extra in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=USER, **{"max_tokens": 2, **extra})
        assert set(info.value.body) == {"message", "type", "param", "code"} and info.value.body["param"]
    with pytest.raises(openai.BadRequestError) as suffix:
        client.completions.create(model="tiny", prompt="x", suffix="y", max_tokens=2)
    assert suffix.value.body["param"] == "suffix"


def test_stream_n2_indexes_and_the_usage_chunk_last(client: "openai.OpenAI") -> None:
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=4, n=2, seed=3,
                                                 temperature=1.0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert {c.id for c in chunks} == {chunks[0].id} and all(c.object == "chat.completion.chunk" for c in chunks)
    finals = {ch.index: ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason}
    assert finals == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_async_client_and_a_left_stream_free_the_server(server: ServerProcess) -> None:
    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=60) as aclient:
            outs = await asyncio.gather(*[aclient.chat.completions.create(
                model="tiny", messages=USER, max_tokens=3, temperature=0) for _ in range(3)])
            stream = await aclient.completions.create(model="tiny", prompt="x", max_tokens=900, stream=True,
                                                      extra_body={"ignore_eos": True})
            async for _ in stream:
                break
            await stream.close()
            task = asyncio.create_task(aclient.completions.create(model="tiny", prompt="x", max_tokens=900,
                                                                  extra_body={"ignore_eos": True}))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return [o.choices[0].message.content for o in outs]

    texts = asyncio.run(run())
    assert len(set(texts)) == 1
    deadline = time.monotonic() + 10
    while True:
        lines = httpx.get(f"{server.url}/metrics").text.splitlines()
        busy = [line for line in lines if line.startswith(("loraplex:num_requests_running ",
                                                           "loraplex:num_requests_waiting "))]
        if all(float(line.split()[-1]) == 0 for line in busy) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert busy and all(float(line.split()[-1]) == 0 for line in busy), busy
    assert json.loads(httpx.get(f"{server.url}/health").text)["status"] == "ok"


def test_responses_call_cut_at_max_output_tokens_is_the_same_streamed_or_not(client: "openai.OpenAI") -> None:
    """The Responses API as chat: a cut call was a message item holding the raw call markup without stream and
    a function_call item streamed; both are the function_call item now (the response `incomplete`)."""
    tools = [{"type": "function", "name": "pick", "parameters": DIGIT}]
    kwargs = dict(model="tiny", input=USER[0]["content"], tools=tools, tool_choice="required", temperature=0)
    need = client.responses.create(max_output_tokens=120, **kwargs).usage.output_tokens

    def items(response: Any) -> list[tuple[str, ...]]:
        return [(o.type, o.name, o.arguments) if o.type == "function_call" else (o.type, o.content[0].text)
                for o in response.output]

    num_cut_calls = 0
    for max_output_tokens in (need - 1, need - 8, 3):
        plain = client.responses.create(max_output_tokens=max_output_tokens, **kwargs)
        events = list(client.responses.create(max_output_tokens=max_output_tokens, stream=True, **kwargs))
        final = events[-1].response
        assert plain.status == final.status == "incomplete"
        assert items(plain) == items(final), max_output_tokens
        num_cut_calls += any(o.type == "function_call" for o in plain.output)
    assert num_cut_calls >= 1


def test_echo_with_max_tokens_0_scores_the_prompt(client: "openai.OpenAI") -> None:
    """OpenAI's legacy scoring call (and vLLM's echo without generation): `echo` + `max_tokens: 0` answers the
    prompt and its logprobs, nothing generated. It was a 400 (max_tokens must be at least 1)."""
    prompt = "def add(a, b):"
    one = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == one.usage.prompt_tokens
    assert choice.logprobs.tokens == one.choices[0].logprobs.tokens[:-1]
    assert choice.logprobs.token_logprobs == pytest.approx(one.choices[0].logprobs.token_logprobs[:-1], abs=1e-5)
    chunks = list(client.completions.create(model="tiny", prompt=[prompt, "x"], max_tokens=0, echo=True, n=2,
                                            stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: prompt, 1: prompt, 2: "x", 3: "x"} and chunks[-1].usage.completion_tokens == 0
    for call in (lambda: client.completions.create(model="tiny", prompt=prompt, max_tokens=0),
                 lambda: client.chat.completions.create(model="tiny", messages=USER, max_tokens=0)):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.body["param"] == "max_tokens"


def test_responses_output_with_reasoning_goes_back_as_input() -> None:
    """`input += response.output` with a --reasoning-parser answer sends its `reasoning` items back: they were a
    400 (unsupported input item type); they are the next assistant turn's reasoning_content (or a turn of their
    own), as a chat answer's message sent back carries it."""
    from gateway.errors import APIError
    from gateway.routes.responses_api import ResponsesRequest, chat_request

    def reasoning(text: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
                "content": [{"type": "reasoning_text", "text": text}]}

    answer = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
              "content": [{"type": "output_text", "text": "Yes.", "annotations": [], "logprobs": []}]}
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "pick", "arguments": '{"a": 1}',
            "status": "completed"}
    body = ResponsesRequest.model_validate({"model": "tiny", "input": [
        {"role": "user", "content": "Is 7 prime?"}, reasoning("7 has no divisors."), answer,
        {"role": "user", "content": "Pick one."}, reasoning("Any digit."), call,
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
        reasoning("Dangling."), {"role": "user", "content": "Thanks."}]})
    turns = [m.for_template() for m in chat_request(body).messages]
    assert [(t["role"], t.get("reasoning_content")) for t in turns] == [
        ("user", None), ("assistant", "7 has no divisors."), ("user", None), ("assistant", "Any digit."),
        ("tool", None), ("assistant", "Dangling."), ("user", None)]
    assert turns[1]["content"] == "Yes." and turns[5]["content"] == ""
    for bad, param in [({**reasoning("x"), "encrypted_content": "gAAA"}, "input[0].encrypted_content"),
                       ({**reasoning("x"), "content": [{"type": "output_text", "text": "x"}]}, "input[0].content[0]")]:
        with pytest.raises(APIError) as info:
            chat_request(ResponsesRequest.model_validate({"model": "tiny", "input": [bad]}))
        assert info.value.status == 400 and info.value.param == param


def test_chat_logprob_bytes_are_the_tokens_own(server: ServerProcess, client: "openai.OpenAI") -> None:
    """`bytes` lets a client join the parts of a character split over tokens (OpenAI's documented use): a token
    holding one byte of a character had the UTF-8 of U+FFFD (its decoded text) as its bytes."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.model)
    text = "é中"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.decode([i]) == "\ufffd" for i in ids)   # this small vocabulary splits them into bytes
    joined: list[int] = []
    for token_id in ids:   # each token forced in turn: its logprob entry's bytes
        out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=1, temperature=0,
                                             logprobs=True, logit_bias={str(token_id): 100})
        entry = out.choices[0].logprobs.content[0]
        assert entry.token == tok.decode([token_id])
        joined += entry.bytes
    assert bytes(joined).decode("utf-8") == text


def test_logprob_bytes_of_a_sentencepiece_byte_fallback_piece() -> None:
    """Llama 2 / Mistral / Gemma vocabularies write a byte as a `<0xNN>` piece: its bytes are that byte."""
    from gateway.outputs.responses import TokenTexts

    class Pieces:
        vocab = {1: "<0xE4>", 2: "<0xB8>", 3: "<0xAD>", 4: "▁ok", 5: "<0xZZ>"}

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            piece = self.vocab[ids[0]]
            return "\ufffd" if piece.startswith("<0x") else piece.replace("▁", " ")

        def convert_ids_to_tokens(self, token_id: int) -> str:
            return self.vocab[token_id]

    texts = TokenTexts(Pieces())  # type: ignore[arg-type]
    assert bytes(b for i in (1, 2, 3) for b in texts.chat_token(i)[1]).decode() == "中"
    assert texts.chat_token(4) == (" ok", list(b" ok"))
    assert texts.chat_token(5) == ("\ufffd", list("\ufffd".encode()))   # not a byte piece: the text's bytes
