"""core/models/meta_init.py: `materialize` places a meta-built model as `to_empty(device).to(dtype)` did (same
parameters, buffers, dtypes, flags), and `skip_param_init` skips only meta modules' init, even across threads."""
from __future__ import annotations

import threading

import torch

from core.attention.torch_backend import TorchAttentionBackend
from core.config import ModelConfig
from core.models.llama import LlamaForCausalLM
from core.models.meta_init import materialize, skip_param_init
from testlib import model_dir


def _meta_model(name: str) -> LlamaForCausalLM:
    cfg = ModelConfig.from_path(model_dir(name))
    with torch.device("meta"), skip_param_init():
        return LlamaForCausalLM(cfg, TorchAttentionBackend(), 64)


def _layout(model: torch.nn.Module) -> list[tuple]:
    params = [(n, tuple(p.shape), p.dtype, p.device.type, p.requires_grad, type(p).__name__)
              for n, p in model.named_parameters(remove_duplicate=False)]
    buffers = [(n, tuple(b.shape), b.dtype, b.device.type) for n, b in model.named_buffers(remove_duplicate=False)]
    return params + buffers


def test_materialize_matches_to_empty_then_to_dtype() -> None:
    for name in ("llama_gqa", "qwen2_tied"):
        for dtype in (torch.float32, torch.bfloat16):
            ours = materialize(_meta_model(name), torch.device("cpu"), dtype)
            ref = _meta_model(name).to_empty(device="cpu").to(dtype)
            assert _layout(ours) == _layout(ref)
            assert not any(p.is_meta for p in ours.parameters()) and not any(b.is_meta for b in ours.buffers())


def test_real_modules_keep_their_init_inside_the_context() -> None:
    torch.manual_seed(0)
    expected = torch.nn.Linear(8, 4).weight.detach().clone()
    with skip_param_init():
        torch.manual_seed(0)
        got = torch.nn.Linear(8, 4).weight.detach().clone()   # a real module, built while the patch is on
    assert torch.equal(got, expected)


def test_overlapping_uses_restore_the_original_init() -> None:
    original = {cls: cls.reset_parameters for cls in (torch.nn.Linear, torch.nn.Embedding)}
    a, b = skip_param_init(), skip_param_init()
    entered_b, exited_a = threading.Event(), threading.Event()

    def other() -> None:                 # B enters after A and exits after A has exited
        b.__enter__()
        entered_b.set()
        exited_a.wait(10)
        b.__exit__(None, None, None)

    a.__enter__()
    thread = threading.Thread(target=other)
    thread.start()
    assert entered_b.wait(10)
    a.__exit__(None, None, None)
    assert torch.nn.Linear.reset_parameters is not original[torch.nn.Linear]   # B still inside
    exited_a.set()
    thread.join(10)
    assert all(cls.reset_parameters is fn for cls, fn in original.items())
