"""LoRALinear / apply_lora_wrappers behaviour outside the numeric parity tests."""

import numpy as np
import pytest
import torch
from torch import nn

from adapters.adapter import LoRAAdapter, LoRAModule
from adapters.layers.dims import GROUP_ATTRS, BaseModelDims, fused_groups
from adapters.errors import LoRAContextError
from adapters.layers.lora_linear import LoRALinear, apply_lora_wrappers, remove_lora_wrappers
from adapters.slots.slot_pool import LoRASlotPool

DIMS = BaseModelDims(hidden_size=16, intermediate_size=24, num_heads=4, num_kv_heads=2,
                     head_dim=4, num_layers=2, vocab_size=32)


def tiny_model(bias=True):
    root = nn.Module()
    root.layers = nn.ModuleList()
    for _ in range(DIMS.num_layers):
        layer = nn.Module()
        layer.self_attn, layer.mlp = nn.Module(), nn.Module()
        for group, (parent, attr) in GROUP_ATTRS.items():
            grp = fused_groups(DIMS)[group]
            setattr(getattr(layer, parent), attr, nn.Linear(grp.in_features, grp.out_features,
                                                            bias=bias and group == "qkv"))
        root.layers.append(layer)
    return root


def loaded_pool():
    pool = LoRASlotPool(num_slots=2, max_rank=4, dims=DIMS)
    g = torch.Generator().manual_seed(0)
    mods = {(l, "v_proj"): LoRAModule(torch.randn(4, 16, generator=g), torch.randn(8, 4, generator=g), 2.0)
            for l in range(2)}
    slot = pool.load("a", LoRAAdapter("a", "a", mods))
    return pool, slot, mods


def test_wraps_every_fused_linear_idempotently():
    model = tiny_model()
    pool, _, _ = loaded_pool()
    apply_lora_wrappers(model, pool)
    apply_lora_wrappers(model, pool)
    for layer in model.layers:
        for parent, attr in GROUP_ATTRS.values():
            mod = getattr(getattr(layer, parent), attr)
            assert isinstance(mod, LoRALinear) and isinstance(mod.base, nn.Linear)
    assert model.layers[1].self_attn.qkv_proj.weight.shape == (32, 16)
    remove_lora_wrappers(model)
    assert type(model.layers[0].mlp.down_proj) is nn.Linear


def test_base_only_step_returns_base_output_unchanged():
    model = tiny_model()
    pool, slot, _ = loaded_pool()
    apply_lora_wrappers(model, pool)
    qkv = model.layers[0].self_attn.qkv_proj
    x = torch.randn(5, 16)
    want = qkv.base(x)
    assert torch.equal(qkv(x), want)  # no context set
    pool.context.set_batch([-1] * 5)
    assert not pool.context.active
    assert torch.equal(qkv(x), want)


def test_v_slice_offset_and_3d_input():
    model = tiny_model()
    pool, slot, mods = loaded_pool()
    apply_lora_wrappers(model, pool)
    qkv = model.layers[1].self_attn.qkv_proj
    x = torch.randn(2, 3, 16)  # [B, S, in] is flattened to [T, in]
    pool.context.set_batch([slot, -1, slot, slot, -1, -1])
    with torch.no_grad():
        got = qkv(x)
        base = qkv.base(x)
    delta = (got - base).reshape(6, 32)  # [T, out]
    assert torch.count_nonzero(delta[:, :24]) == 0  # q and k untouched
    mod = mods[(1, "v_proj")]
    want_v = 2.0 * (x.reshape(6, 16) @ mod.lora_a.t() @ mod.lora_b.t())  # [T, 8]
    mask = torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.bool)
    torch.testing.assert_close(delta[mask, 24:], want_v[mask], atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(delta[~mask]) == 0


def test_stale_context_is_an_error_and_bad_shapes_rejected():
    model = tiny_model()
    pool, slot, _ = loaded_pool()
    apply_lora_wrappers(model, pool)
    pool.context.set_batch([slot, slot])
    with pytest.raises(LoRAContextError):
        model.layers[0].self_attn.qkv_proj(torch.randn(3, 16))
    pool.context.set_step_slots(np.array([slot, -1, slot]))
    with pytest.raises(LoRAContextError, match="host indices"):      # a device tensor would sync the step
        with pool.context.logit_rows(torch.tensor([0, 2])):
            pass
    with pool.context.logit_rows(np.array([0, 2])):
        assert pool.context.logits_meta(2) is not None
    with pytest.raises(ValueError):
        LoRALinear(nn.Linear(16, 30), fused_groups(DIMS)["qkv"].slice_spec(), pool, 0)
    with pytest.raises(ValueError):
        LoRALinear(nn.Linear(16, 32), [("q_proj", 0, 16), ("v_proj", 16, 8)], pool, 0)
    wrong = tiny_model()
    wrong.layers = wrong.layers[:1]
    with pytest.raises(ValueError):
        apply_lora_wrappers(wrong, pool)
