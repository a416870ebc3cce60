"""PEFT parity at the module level: adapters saved by `peft`, loaded by our loader into the
slot pool, applied through the wrapped fused linears for one mixed flat batch."""

import copy

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import adapters.lora_ops.cpu_packed as cpu_packed  # noqa: E402
import adapters.lora_ops.torch_grouped as torch_grouped  # noqa: E402
from adapters.layers.dims import GROUP_ATTRS, BaseModelDims  # noqa: E402
from adapters.errors import SlotPoolFullError  # noqa: E402
from adapters.layers.lora_linear import LoRALinear, apply_lora_wrappers  # noqa: E402
from adapters.peft.loader import load_peft_adapter  # noqa: E402
from adapters.slots.slot_pool import LoRASlotPool  # noqa: E402

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_CONFIGS = {
    "qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all7-r8-patterns": dict(r=8, lora_alpha=16, target_modules=ALL7,
                             rank_pattern={"down_proj": 4, "layers.1.self_attn.k_proj": 2},
                             alpha_pattern={"o_proj": 3}),
    "rslora-r16": dict(r=16, lora_alpha=16, use_rslora=True,
                       target_modules=["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"],
                       layers_to_transform=[1]),
}
MODULE_PATHS = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                "o": ["self_attn.o_proj"], "gate_up": ["mlp.gate_proj", "mlp.up_proj"],
                "down": ["mlp.down_proj"]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                                   vocab_size=128, max_position_embeddings=64)
    base = transformers.LlamaForCausalLM(cfg).eval()
    dims = BaseModelDims.from_hf_config(cfg)
    peft_models, paths = {}, {}
    for i, (name, kw) in enumerate(ADAPTER_CONFIGS.items()):
        pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **kw)).eval()
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for pname, p in pm.named_parameters():
                if "lora_B" in pname:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)  # non-zero B
        paths[name] = tmp_path_factory.mktemp(name)
        pm.save_pretrained(paths[name])
        peft_models[name] = pm
    return base, dims, peft_models, paths


def fused_model(base, dims):
    """A stand-in for core/models: layers[i].self_attn.qkv_proj etc. as fused nn.Linear."""
    root = nn.Module()
    root.layers = nn.ModuleList()
    for hf_layer in base.model.layers:
        layer = nn.Module()
        layer.self_attn, layer.mlp = nn.Module(), nn.Module()
        for group, (parent, attr) in GROUP_ATTRS.items():
            ws = [hf_layer.get_submodule(p).weight for p in MODULE_PATHS[group]]
            w = torch.cat(ws, 0)  # [out_total, in]
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight.data.copy_(w)
            setattr(getattr(layer, parent), attr, lin)
        root.layers.append(layer)
    return root


def peft_delta(peft_model, layer_idx, path, x):
    """PEFT's LoRA delta of one unfused module: module(x) - base_layer(x)."""
    mod = peft_model.base_model.model.model.layers[layer_idx].get_submodule(path)
    if not hasattr(mod, "base_layer"):  # module not targeted in this layer
        return torch.zeros(x.shape[0], mod.out_features)
    return mod(x) - mod.base_layer(x)


def check_parity(model, pool, dims, peft_models, slot_to_name, token_slots, atol):
    pool.context.set_batch(token_slots)
    slots = torch.tensor(token_slots)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            for group, (parent, attr) in GROUP_ATTRS.items():
                wrapper = getattr(getattr(layer, parent), attr)
                assert isinstance(wrapper, LoRALinear)
                x = torch.randn(len(token_slots), wrapper.in_features, generator=g)  # [T, in]
                expected = wrapper.base(x)  # [T, out]
                for slot, name in slot_to_name.items():
                    rows = slots == slot
                    deltas = [peft_delta(peft_models[name], i, p, x) for p in MODULE_PATHS[group]]
                    expected[rows] += torch.cat(deltas, 1)[rows]  # [T, out] -> rows
                got = wrapper(x).float()
                assert (got - wrapper.base(x)).abs().max() > 1e-2  # LoRA really contributes
                torch.testing.assert_close(got, expected, atol=atol, rtol=1e-2 if atol > 1e-3 else 1e-5,
                                           msg=f"layer {i} {group}")
    pool.context.clear()


def test_loader_reads_ranks_and_scaling(setup):
    _, dims, peft_models, paths = setup
    ad = load_peft_adapter(paths["all7-r8-patterns"], dims, max_lora_rank=16)
    assert ad.module(0, "down_proj").rank == 4 and ad.module(1, "k_proj").rank == 2
    assert ad.module(0, "k_proj").rank == 8
    assert ad.module(0, "o_proj").scaling == pytest.approx(3 / 8)
    assert ad.module(0, "q_proj").scaling == pytest.approx(2.0)
    rs = load_peft_adapter(paths["rslora-r16"], dims, max_lora_rank=16)
    assert rs.layers == frozenset({1}) and rs.module(1, "q_proj").scaling == pytest.approx(16 / 4)
    qv = load_peft_adapter(paths["qv-r4"], dims, max_lora_rank=16)
    assert qv.target_modules == frozenset({"q_proj", "v_proj"})


@pytest.mark.parametrize("path", ["mm", "onednn-packed", "per-adapter"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mixed_batch_matches_peft(setup, dtype, path, monkeypatch):
    """mm: the step's adapters stacked into one pair (adapters/lora_ops/cpu_stacked.py, this batch's layout on the
    CPU) through `torch.mm`; onednn-packed: every product of at least PACKED_MIN_ROWS rows through the CPU's
    oneDNN-packed pair (adapters/lora_ops/cpu_packed.py), which this tiny model's sizes would otherwise never
    choose; per-adapter: the stacked pair off (the fused and padded paths of torch_grouped.py)."""
    base, dims, peft_models, paths = setup
    calls = []
    packed = path == "onednn-packed"
    if packed:
        if not cpu_packed.packing_available():
            pytest.skip("no oneDNN packed linear in this torch build")
        monkeypatch.setattr(cpu_packed, "PACKED_MIN_WORK", 0)
        real_shrink = cpu_packed.PackedSlot.shrink
        monkeypatch.setattr(cpu_packed.PackedSlot, "shrink",
                            lambda w, x: calls.append(x.shape[0]) or real_shrink(w, x))
    stacked = []
    if path == "per-adapter":
        monkeypatch.setattr(torch_grouped, "stacked_pays", lambda meta: False)
    else:
        real_stacked = torch_grouped.torch_add_lora_stacked
        monkeypatch.setattr(torch_grouped, "torch_add_lora_stacked",
                            lambda *a, **k: stacked.append(real_stacked(*a, **k)) or stacked[-1])
    pool = LoRASlotPool(num_slots=4, max_rank=16, dims=dims, dtype=dtype)
    model = fused_model(base, dims)
    apply_lora_wrappers(model, pool)
    slot_to_name = {}
    for name in ["rslora-r16", "qv-r4", "all7-r8-patterns"]:  # slot order != name order
        slot_to_name[pool.load(("gen", name), load_peft_adapter(paths[name], dims, 16))] = name
    pool.check_integrity()
    rev = {n: s for s, n in slot_to_name.items()}
    a, b, c = rev["qv-r4"], rev["all7-r8-patterns"], rev["rslora-r16"]
    # Requests as contiguous runs, a slot repeated non-adjacently, base tokens, one unused slot.
    token_slots = [b] * 5 + [-1] * 3 + [a] * 4 + [c] + [b] * 2 + [-1] + [a, c, c, b]
    if dtype == torch.float32:
        check_parity(model, pool, dims, peft_models, slot_to_name, token_slots, atol=1e-5)
    else:  # bf16 pool weights vs the fp32 PEFT reference
        model.to(dtype)
        check_parity_bf16(model, pool, peft_models, slot_to_name, token_slots)
    assert bool(calls) == packed and all(n >= cpu_packed.PACKED_MIN_ROWS for n in calls)
    assert (bool(stacked) and all(stacked)) == (path != "per-adapter")    # taken, not refused


def check_parity_bf16(model, pool, peft_models, slot_to_name, token_slots):
    """bf16 wrappers on bf16 inputs against the fp32 reference computed on the same inputs."""
    pool.context.set_batch(token_slots)
    slots = torch.tensor(token_slots)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            for group, (parent, attr) in GROUP_ATTRS.items():
                wrapper = getattr(getattr(layer, parent), attr)
                x = torch.randn(len(token_slots), wrapper.in_features, generator=g).to(torch.bfloat16)
                expected = x.float() @ wrapper.base.weight.float().t()  # [T, out]
                for slot, name in slot_to_name.items():
                    rows = slots == slot
                    deltas = [peft_delta(peft_models[name], i, p, x.float()) for p in MODULE_PATHS[group]]
                    expected[rows] += torch.cat(deltas, 1)[rows]
                got = wrapper(x).float()
                err = (got - expected).abs().max() / expected.abs().max()
                assert err < 2e-2, f"layer {i} {group}: rel err {err}"
    pool.context.clear()


def test_eviction_keeps_parity(setup):
    base, dims, peft_models, paths = setup
    pool = LoRASlotPool(num_slots=2, max_rank=16, dims=dims)
    model = fused_model(base, dims)
    apply_lora_wrappers(model, pool)
    ads = {n: load_peft_adapter(p, dims, 16) for n, p in paths.items()}
    s1 = pool.load("qv-r4", ads["qv-r4"], pin=True)
    s2 = pool.load("rslora-r16", ads["rslora-r16"], pin=True)
    assert not pool.can_load("all7-r8-patterns")
    with pytest.raises(SlotPoolFullError):
        pool.load("all7-r8-patterns", ads["all7-r8-patterns"])
    pool.unpin(s1)
    s3 = pool.load("all7-r8-patterns", ads["all7-r8-patterns"])  # evicts qv-r4 (small rank, q/v only)
    assert s3 == s1 and pool.slot_of("qv-r4") is None
    pool.check_integrity()
    check_parity(model, pool, dims, peft_models, {s2: "rslora-r16", s3: "all7-r8-patterns"},
                 [s3, s3, s2, -1, s2, s3, -1], atol=1e-5)
    pool.unpin_all()
    s4 = pool.load("qv-r4", ads["qv-r4"])  # evicts the LRU one: rslora (loaded before all7)
    assert s4 == s2
    pool.check_integrity()
    check_parity(model, pool, dims, peft_models, {s4: "qv-r4", s3: "all7-r8-patterns"},
                 [s4, s3, -1, s4, s4], atol=1e-5)
