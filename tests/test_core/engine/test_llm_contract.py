"""The offline Python API exactly as DESIGN.md writes it (`from core import LLM, SamplingParams`), the vLLM
spellings a script ported from vLLM passes: `use_tqdm`, `enable_lora`, `trust_remote_code`, `tokenizer`, and the
shapes of `generate`'s arguments a caller may pass (one prompt, token ids, no prompt, one adapter name, an unknown
one, lists of the wrong length), and a `generate` interrupted midway (Ctrl-C in a notebook) leaves nothing behind."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")

from core import LLM, SamplingParams  # noqa: E402
from lora_fixtures import adapter_dir  # noqa: E402
from testlib import model_dir  # noqa: E402

MODEL = "llama_gqa"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


def test_the_design_snippet_and_vllm_keywords() -> None:
    with LLM(model=str(model_dir(MODEL)), dtype="float32", device="cpu", enable_lora=True, trust_remote_code=False,
             tokenizer=str(model_dir(MODEL)), lora_modules={"tenant-a": str(adapter_dir(MODEL, "qv_r4"))}) as llm:
        prompts = ["def f(x):", "import os", "x = 1"]
        greedy = SamplingParams(max_tokens=6, temperature=0.0)
        outs = llm.generate(prompts, greedy, lora=["tenant-a", None, "tenant-a"], use_tqdm=False)
        assert len(outs) == len(prompts)
        for out, prompt in zip(outs, prompts):
            assert out.prompt == prompt and isinstance(out.text, str)
            assert len(out.token_ids) == 6 and out.finish_reason in ("stop", "length")
        # one SamplingParams per prompt, outputs in the prompts' order
        per = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (1, 2, 3)])
        assert [len(o.token_ids) for o in per] == [1, 2, 3] and [o.finish_reason for o in per] == ["length"] * 3
        # the adapter changes nothing but its own prompts: the base prompt equals a base-only run
        base_only = llm.generate([prompts[1]], greedy)[0]
        assert base_only.token_ids == outs[1].token_ids
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
        done = llm.generate(prompts[:2], SamplingParams(max_tokens=64, temperature=0.0), lora=["tenant-a", None],
                            response_format=fmt)
        for out in done:
            if out.finish_reason == "stop":
                assert isinstance(json.loads(out.text)["a"], int)
            else:
                assert out.finish_reason == "length"
    with pytest.raises(RuntimeError):   # shut down by the with block
        llm.generate(["x"], greedy)


def test_generate_argument_shapes_and_errors() -> None:
    with LLM(model=str(model_dir(MODEL)), dtype="float32", device="cpu", warmup=False, num_kv_blocks=64,
             lora_modules={"tenant-a": str(adapter_dir(MODEL, "qv_r4"))}) as llm:
        greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        assert llm.generate([], greedy) == []
        one = llm.generate("def f(x):", greedy)                      # one prompt, not in a list
        assert len(one) == 1 and len(one[0].token_ids) == 3
        ids = llm.get_tokenizer().encode("def f(x):")
        assert [o.token_ids for o in llm.generate([ids], greedy)] == [one[0].token_ids]
        assert [o.token_ids for o in llm.generate({"prompt_token_ids": ids}, greedy)] == [one[0].token_ids]
        single = llm.generate(["a", "b"], greedy, lora="tenant-a")     # one adapter name for every prompt
        assert [o.token_ids for o in single] == [o.token_ids for o in llm.generate(["a", "b"], greedy,
                                                                                   lora=["tenant-a"] * 2)]
        two = llm.generate(["a"], SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=3))
        assert len(two) == 1 and len(two[0].outputs) == 2
        # an unknown adapter: a plain ValueError (also a KeyError) naming it, raised before anything runs
        with pytest.raises(ValueError, match="no LoRA adapter named 'nope'") as excinfo:
            llm.generate(["a", "b"], greedy, lora=[None, "nope"])
        assert isinstance(excinfo.value, KeyError) and str(excinfo.value).startswith("no LoRA")
        assert not llm.engine.has_unfinished_requests()
        for bad in ({"sampling_params": [greedy]}, {"sampling_params": greedy, "lora": ["tenant-a"]}):
            with pytest.raises(ValueError, match="1 entries for 2 prompts"):
                llm.generate(["a", "b"], **bad)
        assert [len(o.token_ids) for o in llm.generate(["a"], greedy)] == [3]   # still serves
