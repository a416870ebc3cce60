"""vLLM's offline `LLM.chat`: conversations rendered with the model's chat template equal the server's chat
prompt (the BOS where the template writes none), generated as `generate` would; one output per conversation."""
from __future__ import annotations

from pathlib import Path

import pytest

from core import LLM, SamplingParams
from gateway_server import model_with_chat_template
from testlib import CHAT_TEMPLATES

USER = [{"role": "user", "content": "Write a function that adds two numbers."}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = model_with_chat_template(tmp_path_factory.mktemp("llm_chat"), CHAT_TEMPLATES / "thinking_kwarg.jinja")
    return LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=128)


def test_chat_equals_generate_on_the_rendered_prompt(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert not text.startswith(tok.bos_token)   # this template writes no BOS: chat adds it, as the server does
    ids = tok.encode(text)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    want = llm.generate([ids], params)[0].outputs[0].token_ids
    other = [{"role": "user", "content": "Now multiply them."}]
    outs = llm.chat([USER, other], params)
    assert len(outs) == 2 and outs[0].prompt_token_ids == ids and outs[0].outputs[0].token_ids == want
    assert llm.chat(USER, params)[0].outputs[0].token_ids == want   # one conversation: one output
    thinking = llm.chat(USER, params, chat_template_kwargs={"enable_thinking": False})[0]
    assert thinking.prompt_token_ids != ids   # the template's variable reached it


def test_chat_options_are_checked(llm: LLM) -> None:
    with pytest.raises(ValueError):
        llm.chat(USER, continue_final_message=True)   # with add_generation_prompt (the default)
    partial = [*USER, {"role": "assistant", "content": "def add(a, b):"}]
    out = llm.chat(partial, SamplingParams(max_tokens=2, temperature=0.0), add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert llm.get_tokenizer().decode(out.prompt_token_ids).rstrip().endswith("def add(a, b):")
