"""Tool conversations through templates shaped as real models' (tests/helpers/chat_templates/): named templates
(a `tool_use` one beside `default`), a tool turn's `name`, vLLM's `tool_calls: []` and empty `arguments` in
history; and calls whose close a `stop` string cut. No server: the prompt is rendered as the server renders it."""
from __future__ import annotations

import json
import re
from typing import Any

import pytest

from testlib import CHAT_TEMPLATES

from gateway.inputs.prompts import PromptEncoder
from gateway.protocol import ChatCompletionRequest
from gateway.tools.tool_output import _ChoiceStream, tool_chat_body
from gateway.tools.tool_parse import final_calls
from gateway.tools.tools import chat_prompt, plan_tools
from gateway.outputs.generation import ChoiceResult
from grammar.specs.spec import DEFAULT_OPTIONS
from grammar.specs.tool_calls import HERMES, LLAMA3_JSON

TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from tiny_models import build_tokenizer

    return AutoTokenizer.from_pretrained(str(build_tokenizer(tmp_path_factory.mktemp("tok"))))


def render(tokenizer: Any, template: Any, **body: Any) -> str:
    tokenizer.chat_template = template
    request = ChatCompletionRequest(**body)
    plan = plan_tools(request, tokenizer, DEFAULT_OPTIONS)
    return tokenizer.decode(chat_prompt(PromptEncoder(tokenizer, len(tokenizer)), request, plan))


def history(call: dict[str, Any], **tool_turn: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "find x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "found", **tool_turn}]


CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}


def test_named_templates_render_tools_with_tool_use(tokenizer: Any) -> None:
    """A tokenizer with named templates (Hermes-2-Pro, Hermes-3 and Command-R ship `default` + `tool_use`; the
    tokenizer's `chat_template` is then a dict): the tool syntax was looked for in the dict's keys, never found,
    so the tool_use template was bypassed for the gateway's fallback text in the plain `default` one."""
    tool_use = (CHAT_TEMPLATES / "hermes2pro_tool_use.jinja").read_text()
    text = render(tokenizer, {"default": PLAIN, "tool_use": tool_use},
                  messages=history(CALL, name="lookup"), tools=[TOOL])
    assert "You are a function calling AI model." in text and json.dumps(TOOL["function"]) in text
    assert '<tool_call>\n{"arguments": {"q": "x"}, "name": "lookup"}\n</tool_call>' in text
    assert '<tool_response>\n{"name": "lookup", "content": "found"}\n</tool_response>' in text
    # without tools, transformers renders `default`: a plain chat still reaches it
    assert render(tokenizer, {"default": PLAIN, "tool_use": tool_use},
                  messages=[{"role": "user", "content": "hi"}]).endswith("<|im_start|>user\nhi<|im_end|>\n"
                                                                         "<|im_start|>assistant\n")


def test_tool_turn_name_reaches_the_template(tokenizer: Any) -> None:
    """A tool turn's `name` (Hermes-2-Pro's template raises without it) was dropped before the template: a 400
    "the chat template rejected the messages" for the history its own format asks for. vLLM passes it."""
    text = render(tokenizer, (CHAT_TEMPLATES / "hermes2pro_tool_use.jinja").read_text(),
                  messages=history(CALL, name="lookup"), tools=[TOOL])
    assert '{"name": "lookup", "content": "found"}' in text


def test_empty_tool_calls_and_empty_arguments_in_history(tokenizer: Any) -> None:
    """vLLM's answers carry `tool_calls: []`; sent back as history it reached a Llama 3.1 template as a call turn
    (`'tool_calls' in message`) with no call: "This model only supports single tool-calls at once!" (400).
    `arguments: ""` (a call of a function with no parameters, as some clients write it) was a 400; vLLM reads {}.
    So was `arguments` sent as an object (clients that keep it parsed); vLLM takes it as is."""
    template = (CHAT_TEMPLATES / "llama31_official.jinja").read_text()
    text = render(tokenizer, template, tools=[TOOL], messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "tool_calls": []},
        {"role": "user", "content": "find x"}])
    assert "<|start_header_id|>assistant<|end_header_id|>\n\nhello<|eot_id|>" in text
    call = {"id": "call_2", "type": "function", "function": {"name": "lookup", "arguments": ""}}
    text = render(tokenizer, template, tools=[TOOL], messages=history(call))
    assert '{"name": "lookup", "parameters": {}}<|eot_id|>' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"found"<|eot_id|>' in text
    call = {"id": "call_3", "type": "function", "function": {"name": "lookup", "arguments": {"q": "y"}}}
    assert '{"name": "lookup", "parameters": {"q": "y"}}' in render(tokenizer, template, tools=[TOOL],
                                                                     messages=history(call))


@pytest.mark.parametrize("fmt, stop", [(HERMES, "</tool_call>"), (LLAMA3_JSON, "}")])
def test_call_whose_close_a_stop_string_cut_is_a_call(fmt: Any, stop: str) -> None:
    """A `stop` string inside the call's close (e.g. stop=["</tool_call>"]) ends the output after whole
    arguments: the answer had no tool_calls and the raw call text as content (the stream had sent the call, and
    ended with finish_reason "stop"); as vLLM's parsers read an unclosed last call, it is a call."""
    args = json.dumps({"q": "x }\n</tool_call>", "n": [1, {"m": "é"}]}, ensure_ascii=False)
    full = "Sure.\n" + fmt.call_text("lookup", args)
    text = full[:full.rindex(stop)] if stop != "}" else full[:-1]
    content, calls = final_calls(text, fmt)
    assert content == "Sure.\n" and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("lookup", args)]
    plan = plan_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[TOOL]),
                      None, DEFAULT_OPTIONS, parser=fmt.family)
    body = tool_chat_body(plan)("id", 0, "m", [ChoiceResult(0, text, finish_reason="stop")], {}, None)
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    stream, sent, complete = _ChoiceStream(), "", False
    for k in range(0, len(text), 3):   # streamed: the same arguments, and the same finish_reason
        delta, complete = stream.step(plan, text[k:k + 3], k + 3 >= len(text))
        sent += "".join(c["function"].get("arguments", "") for c in delta.get("tool_calls", []))
    assert sent == args and complete


ALTERNATING = ("{{ bos_token }}{% for m in messages %}"
               "{% if (m.role == 'user') != (loop.index0 % 2 == (1 if messages[0].role == 'system' else 0)) "
               "and m.role != 'system' %}{{ raise_exception('Conversation roles must alternate "
               "user/assistant/user/assistant/...') }}{% endif %}"
               "[{{ m.role }}]{{ m.content }}[/{{ m.role }}]{% endfor %}"
               "{% if add_generation_prompt %}[assistant]{% endif %}")


def test_fallback_groups_tool_results_in_one_user_turn(tokenizer: Any) -> None:
    """A template without tool syntax that makes roles alternate (Gemma's, Mistral v0.1/v0.2's shape): the
    results of two parallel calls became two user turns in a row, and the template's raise a 400. They share
    one user turn now (as Qwen's template groups them), a user's message after them too; non-ASCII arguments
    and descriptions are written as `tojson` writes them, not as \\u escapes."""
    tool = {"type": "function", "function": {"name": "lookup", "description": "查找", "parameters": {}}}
    calls = [{"id": f"c{k}", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"q": q})}}
             for k, q in enumerate(["日本", "x"])]
    text = render(tokenizer, ALTERNATING, tools=[tool], messages=[
        {"role": "user", "content": "find"}, {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c0", "content": "one"}, {"role": "tool", "tool_call_id": "c1",
                                                                      "content": "two"},
        {"role": "user", "content": "and?"}])
    assert '"description": "查找"' in text and '{"name": "lookup", "arguments": {"q": "日本"}}' in text
    assert ("[user]<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response>\nand?[/user]"
            "[assistant]") in text


def test_fallback_tool_list_joins_a_developer_message(tokenizer: Any) -> None:
    """A first `developer` message (OpenAI's newer name for system) was not seen as the system turn: the tool
    list went into a second system turn before it, which role-alternating templates refuse (400)."""
    text = render(tokenizer, ALTERNATING, tools=[TOOL], messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "find x"}])
    assert text.count("[system]") == 1 and "[system]Be brief.\n\n# Tools" in text


def test_tokenize_counts_the_prompt_chat_renders_with_tools(tokenizer: Any) -> None:
    """`/tokenize` with messages (vLLM's body has `tools`): `tools` was an unknown field (400), and a tool
    conversation lost its calls and results (`tool_calls` never reached the template): a count that was not the
    chat prompt's. Now the ids are the chat prompt's (the BOS this template does not write asked for), tools,
    calls and results included."""
    from gateway.routes.tokenize import _tokenize_body, _tokens

    tokenizer.chat_template = (CHAT_TEMPLATES / "hermes_qwen.jinja").read_text()
    encoder = PromptEncoder(tokenizer, len(tokenizer))
    messages = history(CALL)
    for tools in ([TOOL], None):
        raw = {"model": "m", "messages": messages, "add_special_tokens": True, **({"tools": tools} if tools else {})}
        ids = _tokens(encoder, _tokenize_body(json.dumps(raw).encode()))["tokens"]
        chat = ChatCompletionRequest(messages=messages, tools=tools)
        assert ids == chat_prompt(encoder, chat, plan_tools(chat, tokenizer, DEFAULT_OPTIONS))
        assert '{"name": "lookup", "arguments": {"q": "x"}}' in tokenizer.decode(ids)


NO_SYSTEM = ("{{ bos_token }}{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}" + ALTERNATING.removeprefix("{{ bos_token }}"))


def test_fallback_tool_list_in_the_first_user_turn_when_the_template_refuses_system(tokenizer: Any) -> None:
    """Gemma 2's template raises "System role not supported": with tools and no system message of the client's,
    the gateway's own system turn made every tool request a 400. The tool list now opens the first user turn."""
    text = render(tokenizer, NO_SYSTEM, tools=[TOOL], tool_choice="required", messages=history(CALL))
    assert "[system]" not in text and text.count("[user]") == 2
    assert text.index("[user]# Tools") < text.index("find x[/user]") < text.index("[assistant]<tool_call>")


@pytest.mark.parametrize("parameters", [None, {}])
def test_function_without_parameters_is_called_with_empty_arguments(parameters: Any) -> None:
    """OpenAI: "Omitting parameters defines a function with an empty parameter list" (vLLM constrains a missing
    or `{}` schema to the empty object too). It was any object: under `required` the tiny model wrote free keys
    until max_tokens ("length", arguments that were no JSON). Its call grammar now takes `{}` only."""
    import re

    from grammar.specs.tool_calls import tool_calls_spec

    fn = {"name": "now", **({"parameters": parameters} if parameters is not None else {})}
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                 tools=[{"type": "function", "function": fn}], tool_choice="required")
    plan = plan_tools(body, None, DEFAULT_OPTIONS)
    regex = tool_calls_spec(plan.fmt, plan.functions, parallel=False, checked=plan.checked).recipe.lower()
    assert re.fullmatch(regex, HERMES.call_text("now", "{}"))
    assert not re.fullmatch(regex, HERMES.call_text("now", '{"a": 1}'))


def test_mistral_template_renders_tools_calls_and_results(tokenizer: Any) -> None:
    """Mistral v0.3's template (tests/helpers/chat_templates/mistral_v03_tools.jinja) renders the tools itself
    (`[AVAILABLE_TOOLS]`), past calls as `[TOOL_CALLS] [...]` and results as `[TOOL_RESULTS]`, and raises on a
    call id that is not 9 characters long. It was given the Hermes fallback (`<tools>` in a system turn), and
    an OpenAI id such as `call_1` in the history was a 400. Ids are cut to 9 letters and digits (the same for
    the call and its result), as vLLM keeps their last 9 characters."""
    template = (CHAT_TEMPLATES / "mistral_v03_tools.jinja").read_text()
    long_id = {**CALL, "id": "call_0123456789abcdef01234567"}
    for call, short in ((CALL, None), (long_id, "f01234567"), ({**CALL, "id": "abcDEF123"}, "abcDEF123")):
        messages = history(call) + [{"role": "assistant", "content": "x is found"}, {"role": "user", "content": "y?"}]
        text = render(tokenizer, template, messages=messages, tools=[TOOL])
        assert "<tool_call>" not in text and "<tools>" not in text
        assert '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "lookup"' in text
        ids = re.findall(r'\[TOOL_CALLS\] \[\{"name": "lookup", "arguments": \{"q": "x"\}, "id": "(\w+)"\}\]', text)
        results = re.findall(r'\[TOOL_RESULTS\] \{"content": found, "call_id": "(\w+)"\}\[/TOOL_RESULTS\]', text)
        assert len(ids) == 1 and ids == results and re.fullmatch(r"[a-zA-Z0-9]{9}", ids[0]), text
        assert short is None or ids[0] == short
        # without tools in the request the history still renders through the template
        assert re.findall(r'"call_id": "(\w+)"', render(tokenizer, template, messages=messages)) == ids


def test_phi4_mini_functools_template_renders_tools_and_calls(tokenizer: Any) -> None:
    """A template that asks for `functools[...]` (vLLM's Phi-4-mini template) renders the tools itself and is read
    as the phi4_mini_json family (it got the Hermes fallback: `<tools>` and `<tool_call>` text)."""
    template = (CHAT_TEMPLATES / "phi4_mini_functools.jinja").read_text()
    messages = history(CALL) + [{"role": "assistant", "content": "x is found"}, {"role": "user", "content": "y?"}]
    text = render(tokenizer, template, messages=messages, tools=[TOOL])
    assert "<tool_call>" not in text and "<tools>" not in text and json.dumps(TOOL) in text
    assert '<|assistant|>functools[{"name": "lookup", "arguments": {"q": "x"}}]<|end|>' in text
    assert text.endswith("<|user|>y?<|end|><|assistant|>")
