"""DoRA at the module level, against PEFT's own DoRA layers: adapters saved by `peft` (`use_dora=True`), loaded by
our loader into the slot pool, applied through the wrapped fused linears of a Qwen2-shaped layer (biases on
q/k/v: DoRA's bias stays unscaled) for one mixed batch of DoRA rows, plain LoRA rows and base rows, on every path
of the ops: the torch reference (grouped: runs, padded, segmented), the Triton segmented kernels and BGMV decode
kernels (in the interpreter without a GPU), the torch decode path, and the split ops of tensor parallelism's
row-parallel linears (shrink, then expand with its DoRA epilogue)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

from adapters.layers.dims import GROUP_ATTRS, BaseModelDims  # noqa: E402
from adapters.layers.lora_linear import LoRALinear, apply_lora_wrappers  # noqa: E402
from adapters.lora_ops import LoRABackends, LoRABatchMeta, expand, shrink  # noqa: E402
from adapters.lora_ops.bgmv import DecodeLoRAMeta  # noqa: E402
from adapters.lora_ops.bgmv_split import bgmv_expand, bgmv_shrink  # noqa: E402
from adapters.peft.loader import load_peft_adapter  # noqa: E402
from adapters.slots.slot_pool import LoRASlotPool  # noqa: E402
from kernel_device import kernel_device  # noqa: E402

DEVICE = kernel_device()
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "dora-all7": dict(r=8, lora_alpha=16, target_modules=ALL7, use_dora=True),
    "dora-qv-rs": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
                       use_dora=True),
    "lora-kod": dict(r=8, lora_alpha=8, target_modules=["k_proj", "o_proj", "down_proj"]),
}
MODULE_PATHS = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                "o": ["self_attn.o_proj"], "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=1, vocab_size=64, max_position_embeddings=32)
    base = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in base.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)       # nonzero biases: DoRA must leave them unscaled
    dims = BaseModelDims.from_hf_config(cfg)
    peft_models, paths = {}, {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **kw)).eval()
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for pname, p in pm.named_parameters():
                if "lora_B" in pname:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                elif "lora_magnitude_vector" in pname:
                    p.mul_(1.0 + 0.5 * torch.randn(p.shape, generator=g))   # magnitudes far from the init
        paths[name] = tmp_path_factory.mktemp(name)
        pm.save_pretrained(paths[name])
        peft_models[name] = pm
    return base, dims, peft_models, paths


def fused_model(base: nn.Module) -> nn.Module:
    """layers[i].self_attn.qkv_proj etc. as fused nn.Linear with the HF biases (zeros where HF has none)."""
    root = nn.Module()
    root.layers = nn.ModuleList()
    for hf_layer in base.model.layers:
        layer = nn.Module()
        layer.self_attn, layer.mlp = nn.Module(), nn.Module()
        for group, (parent, attr) in GROUP_ATTRS.items():
            mods = [hf_layer.get_submodule(p) for p in MODULE_PATHS[group]]
            w = torch.cat([m.weight for m in mods], 0)                                   # [out_total, in]
            biased = any(m.bias is not None for m in mods)
            lin = nn.Linear(w.shape[1], w.shape[0], bias=biased)
            lin.weight.data.copy_(w)
            if biased:
                lin.bias.data.copy_(torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features)
                                               for m in mods]))
            setattr(getattr(layer, parent), attr, lin)
        root.layers.append(layer)
    return root


def build(setup, backend):
    base, dims, peft_models, paths = setup
    pool = LoRASlotPool(num_slots=4, max_rank=16, dims=dims, device=DEVICE,
                        backends=LoRABackends(backend, backend))
    model = fused_model(base).to(DEVICE)
    apply_lora_wrappers(model, pool)
    slot_to_name = {}
    for name in ["lora-kod", "dora-qv-rs", "dora-all7"]:
        slot_to_name[pool.load(("gen", name), load_peft_adapter(paths[name], dims, 16))] = name
    pool.check_integrity()
    return model, pool, slot_to_name


def expected_output(setup, slot_to_name, wrapper, layer_idx, group, x, slots):
    """PEFT's outputs of the group's modules (each with its DoRA / LoRA / nothing) concatenated, per row's slot."""
    _, _, peft_models, _ = setup
    out = wrapper.base(x).cpu()                                                          # base rows: the base
    xc = x.cpu()
    for slot, name in slot_to_name.items():
        rows = slots == slot
        layer = peft_models[name].base_model.model.model.layers[layer_idx]
        out[rows] = torch.cat([layer.get_submodule(p)(xc) for p in MODULE_PATHS[group]], 1)[rows]
    return out


TOKEN_SLOTS = {  # with slots 0..2 loaded in this order: lora-kod, dora-qv-rs, dora-all7
    "mixed": [2] * 5 + [-1] * 3 + [1] * 4 + [0] + [2] * 2 + [-1] + [1, 0, 0, 2],
    "prefill-run": [2] * 34 + [1, -1, 0],           # a long run of one DoRA slot (the torch path's slices)
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", list(TOKEN_SLOTS))
def test_grouped_dora_matches_peft(setup, backend, case):
    model, pool, slot_to_name = build(setup, backend)
    token_slots = TOKEN_SLOTS[case]
    pool.context.set_batch(token_slots)
    slots = torch.tensor(token_slots)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for group, (parent, attr) in GROUP_ATTRS.items():
            wrapper = getattr(getattr(model.layers[0], parent), attr)
            assert isinstance(wrapper, LoRALinear)
            x = torch.randn(len(token_slots), wrapper.in_features, generator=g).to(DEVICE)  # [T, in]
            want = expected_output(setup, slot_to_name, wrapper, 0, group, x, slots)
            got = wrapper(x).cpu()
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=f"{backend} {group}")
    pool.context.clear()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("token_slots", [[2, -1, 1, 0, 2, 1, -1, 2], TOKEN_SLOTS["prefill-run"]],
                         ids=["decode", "chunk"])
def test_decode_and_split_dora_match_peft(setup, backend, token_slots):
    """Per-row slots (the decode / CUDA-graph metadata), whole and split into shrink + all-reduce + expand as a
    row-parallel linear does it (here one rank: the all-reduce is the identity); "chunk": a mixed-step graph's
    prefill chunk, 34 rows of one DoRA slot in three BGMV groups (the DoRA epilogue once per row)."""
    model, pool, slot_to_name = build(setup, backend)
    slots = torch.tensor(token_slots)
    meta = DecodeLoRAMeta.build(token_slots, DEVICE)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for group, (parent, attr) in GROUP_ATTRS.items():
            wrapper = getattr(getattr(model.layers[0], parent), attr)
            x = torch.randn(len(token_slots), wrapper.in_features, generator=g).to(DEVICE)
            want = expected_output(setup, slot_to_name, wrapper, 0, group, x, slots)
            pool.context.set_meta(meta)
            got = wrapper(x).cpu()
            pool.context.clear()
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=f"decode {backend} {group}")
            y = wrapper.base(x)
            bgmv_expand(y, bgmv_shrink(x, wrapper.stack, meta, backend), wrapper.stack, meta, backend=backend)
            torch.testing.assert_close(y.cpu(), want, atol=2e-5, rtol=1e-5, msg=f"split decode {backend} {group}")
    grouped = LoRABatchMeta.build(token_slots, DEVICE, num_slots=4)
    with torch.no_grad():
        wrapper = model.layers[0].mlp.down_proj
        x = torch.randn(len(token_slots), wrapper.in_features, generator=g).to(DEVICE)
        want = expected_output(setup, slot_to_name, wrapper, 0, "down", x, slots)
        y = wrapper.base(x)
        h = shrink(x, wrapper.stack, grouped, backend=backend)
        expand(y, h, wrapper.stack, grouped, backend=backend)
        torch.testing.assert_close(y.cpu(), want, atol=2e-5, rtol=1e-5, msg=f"split grouped {backend}")


def test_dora_changes_the_output_and_costs_one_norm_per_adapter(setup):
    """The precondition of the parity: each DoRA adapter's output differs from its A / B without the magnitudes;
    the norms are computed once per adapter (a slot rewrite after eviction reuses them)."""
    model, pool, slot_to_name = build(setup, "torch")
    assert pool.num_dora_computes == 2
    stack = pool.stack(0, "qkv")
    dora_slots = stack.dora_slots_host()
    assert {slot_to_name[s] for s in dora_slots} == {"dora-qv-rs", "dora-all7"}
    for slot in dora_slots:
        assert (stack.dora_scale[slot].cpu() - 1).abs().max() > 0.05                  # visibly not the identity
        assert stack.dora_shift[slot].cpu().abs().max() > 0.01                         # q/k/v biases
    _, dims, _, paths = setup
    name = "dora-all7"
    slot = next(s for s, n in slot_to_name.items() if n == name)
    adapter = pool._slot_adapters[slot]
    pool.unload(slot)
    pool.load(("gen", name, 2), adapter)
    assert pool.num_dora_computes == 2
    pool.check_integrity()
