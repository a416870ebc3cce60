"""`--dtype auto` on the CPU: bf16 where the CPU computes it natively (AVX-512 BF16 or AMX-BF16), fp32 elsewhere
(issue 38). A bf16 engine is held to HF transformers in bf16 by the top-2 margin rule: its greedy tokens equal HF's
at every step up to the first one where HF's own top-1/top-2 logit gap is within bf16's rounding (there the two
orders of summation may pick either token, and the continuations part)."""
from __future__ import annotations

import pytest
import torch

from core import LLM, SamplingParams
from core.config import ModelConfig
from core.models import device as device_mod
from core.models.device import cpu_flags, resolve_dtype
from testlib import PROMPTS, SPECS, encode, model_dir

transformers = pytest.importorskip("transformers")

X86_CPUINFO = ("processor\t: 0\nvendor_id\t: GenuineIntel\n"
               "flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile\n\nprocessor\t: 1\nflags\t\t: fpu\n")
ARM_CPUINFO = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\nCPU implementer\t: 0x41\n"
# HF bf16's logits come in steps of 1/16 at these magnitudes: a gap of 0 or one step is a tie to bf16 (seen: the parts happen at gaps 0 and 1/16)
TIE_GAP = 0.125
MAX_TOKENS = 24


def test_cpu_flags_reads_the_first_processor() -> None:
    assert "avx512_bf16" in cpu_flags(X86_CPUINFO)
    assert cpu_flags(X86_CPUINFO) & device_mod.CPU_BF16_FLAGS == {"avx512_bf16"}
    assert cpu_flags(ARM_CPUINFO) & device_mod.CPU_BF16_FLAGS == frozenset()   # arm's bf16 is not what we check
    assert cpu_flags("") == frozenset()


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bf16_exactly_where_the_cpu_has_it(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    monkeypatch.setattr(device_mod, "cpu_has_native_bf16", lambda: native)
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
                                 "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 32,
                                 "torch_dtype": "float32"})
    want = torch.bfloat16 if native else torch.float32
    assert resolve_dtype("auto", cfg, torch.device("cpu")) == want
    assert resolve_dtype("float32", cfg, torch.device("cpu")) == torch.float32     # an explicit dtype always wins
    assert resolve_dtype("auto", cfg, torch.device("meta")) == torch.bfloat16     # not a CPU: the GPU rule


def _hf_bf16_greedy(path, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                          do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    gaps = [float(torch.topk(s[0].float(), 2).values.diff().abs()) for s in out.logits]
    return out.sequences[0, len(prompt_ids):].tolist(), gaps


@pytest.mark.parametrize("name", list(SPECS)[:2])
def test_bf16_engine_follows_hf_bf16_until_a_tie(name: str) -> None:
    path = model_dir(name)
    dtype = "auto" if device_mod.cpu_has_native_bf16() else "bfloat16"
    llm = LLM(str(path), dtype=dtype, device="cpu", num_kv_blocks=128)
    assert next(llm.engine.model.parameters()).dtype == torch.bfloat16
    num_compared = 0
    for prompt in PROMPTS[:6]:
        ids = encode(path, prompt)
        got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].token_ids
        want, gaps = _hf_bf16_greedy(path, ids)
        clear = next((i for i, gap in enumerate(gaps) if gap < TIE_GAP), len(want))
        assert got[:clear] == want[:clear], (name, prompt, clear)
        num_compared += clear
    assert num_compared >= 40, f"test setup: HF bf16 ties too early to compare ({num_compared} tokens)"
    llm.shutdown()
