"""LoRA on MoE experts, unit level: PEFT's target_parameters layout split into per-expert factors (each equal to
PEFT's own delta of that expert), refusals (target_parameters on the shared expert's gate, a dense base, a wrong
expert count), the router's and the shared-expert gate's LoRA on their logits, the expert slots under random loads
and evictions with check_integrity() after every operation (with and without shared-expert gate slots, DoRA on
the router and the gate among them), and the
wrapper's grouped deltas against a per-row loop. The end-to-end parity with PEFT is
tests/test_core/models/test_moe_families.py (the shared-expert gate's: test_lora_shared_expert_gate.py)."""
from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

from adapters.adapter import LoRAAdapter, LoRAModule  # noqa: E402
from adapters.errors import AdapterError, SlotPoolIntegrityError  # noqa: E402
from adapters.layers.context import LoRAContext  # noqa: E402
from adapters.layers.dims import BaseModelDims  # noqa: E402
from adapters.layers.expert_lora import ExpertLoRA, RouterLoRA, SharedGateLoRA  # noqa: E402
from adapters.peft.loader import load_peft_adapter  # noqa: E402
from adapters.slots.slot_pool import LoRASlotPool  # noqa: E402
from core.config import ModelConfig  # noqa: E402
from core.models.llama import silu_and_mul  # noqa: E402
from core.models.moe import Experts, route  # noqa: E402
from lora_fixtures import _fresh_base  # noqa: E402
from lora_tree import _peft_model  # noqa: E402
from moe_adapters import expert_params_adapter, per_expert_adapter  # noqa: E402
from moe_models import moe_dir  # noqa: E402
from tiny_models import tiny_model_dir  # noqa: E402

DIMS = BaseModelDims(hidden_size=16, intermediate_size=24, num_heads=4, num_kv_heads=2, head_dim=4, num_layers=2,
                     vocab_size=32, num_experts=3, moe_intermediate_size=8)
SHARED = dataclasses.replace(DIMS, shared_expert=True)    # Qwen2-MoE: a shared expert and its gate (hidden -> 1)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    path = moe_dir("qwen3_moe")
    out = tmp_path_factory.mktemp("experts")
    return path, expert_params_adapter(path, out / "a", ["experts.gate_up_proj", "experts.down_proj"], ["q_proj"],
                                       4, 8, 1.0, 71)


def test_target_parameters_split_into_each_experts_peft_delta(qwen3: tuple[Path, Path]) -> None:
    """Expert e's (A_e, B_e) of our split give exactly the delta PEFT's ParamWrapper folds into W[e]."""
    path, adapter_dir = qwen3
    cfg = ModelConfig.from_path(path)
    adapter = load_peft_adapter(adapter_dir, BaseModelDims.from_model_config(cfg), max_lora_rank=16)
    peft_model = _peft_model(path, adapter_dir)
    experts = peft_model.base_model.model.model.layers[0].mlp.experts  # ParamWrapper(down) > ParamWrapper(gate_up)
    deltas = {"down_proj": experts.get_delta_weight("default"),
              "gate_up_proj": experts.base_layer.get_delta_weight("default")}
    inter = cfg.moe_intermediate_size
    assert deltas["gate_up_proj"].shape == (cfg.num_experts, 2 * inter, cfg.hidden_size)
    for e in range(cfg.num_experts):
        mods = {p: adapter.expert_modules[(0, e, p)] for p in ("gate_proj", "up_proj", "down_proj")}
        ours = {p: m.scaling * m.lora_b @ m.lora_a for p, m in mods.items()}
        torch.testing.assert_close(torch.cat([ours["gate_proj"], ours["up_proj"]]), deltas["gate_up_proj"][e])
        torch.testing.assert_close(ours["down_proj"], deltas["down_proj"][e])
    assert (1, 0, "gate_proj") not in adapter.expert_modules     # layer 1 is dense (mlp_only_layers)
    assert adapter.module(0, "q_proj") is not None


def _edit(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_refusals(qwen3: tuple[Path, Path], tmp_path: Path) -> None:
    path, adapter_dir = qwen3
    dims = BaseModelDims.from_model_config(ModelConfig.from_path(path))
    for targets in (["mlp.shared_expert_gate.weight"], ["experts.gate_up_proj", "self_attn.q_proj.weight"]):
        bad = _edit(adapter_dir, tmp_path / f"t{len(targets)}", target_parameters=targets)
        with pytest.raises(AdapterError, match="unsupported target parameter") as err:
            load_peft_adapter(bad, dims, max_lora_rank=16)
        assert err.value.status == 400
    # only one of the two tensors named: the other's weights are refused
    bad = _edit(adapter_dir, tmp_path / "one", target_parameters=["experts.gate_up_proj"])
    with pytest.raises(AdapterError, match="target_parameters does not name"):
        load_peft_adapter(bad, dims, max_lora_rank=16)
    dense = BaseModelDims.from_model_config(ModelConfig.from_path(tiny_model_dir()))
    with pytest.raises(AdapterError, match="no such MoE layer") as err:   # expert LoRA on a dense base
        load_peft_adapter(adapter_dir, dense, max_lora_rank=16)
    assert err.value.status == 400
    other = BaseModelDims.from_model_config(ModelConfig.from_path(moe_dir("mixtral")))
    with pytest.raises(AdapterError, match="do not fit|does not exist|no such") as err:   # another expert count
        load_peft_adapter(adapter_dir, other, max_lora_rank=16)
    assert err.value.status == 400


def test_dora_on_experts_is_a_clear_400(qwen3: tuple[Path, Path], tmp_path: Path) -> None:
    """DoRA where it is not served names the reason: on transformers-4 per-expert modules (the message said DoRA
    magnitudes on gate/up/down_proj were supported; without their magnitudes they were served as plain LoRA), and
    through target_parameters (peft has no DoRA there)."""
    path, params = qwen3
    dims = BaseModelDims.from_model_config(ModelConfig.from_path(path))
    per_expert = per_expert_adapter(path, tmp_path / "per-expert", "qwen3_moe", 4, 8, 1.0, 5)
    state = load_file(str(per_expert / "adapter_model.safetensors"))
    save_file({**state, **{k.replace("lora_B.weight", "lora_magnitude_vector"): torch.ones(v.shape[0])
                           for k, v in state.items() if k.endswith("lora_B.weight")}},
              str(per_expert / "adapter_model.safetensors"))
    no_mag = per_expert_adapter(path, tmp_path / "per-expert-plain", "qwen3_moe", 4, 8, 1.0, 5)   # use_dora, no m
    for adapter, match in ((_edit(per_expert, tmp_path / "pe-dora", use_dora=True), r"DoRA \(use_dora\) on the MoE"),
                           (_edit(no_mag, tmp_path / "pe-dora-no-mag", use_dora=True), r"DoRA \(use_dora\) on the MoE"),
                           (_edit(params, tmp_path / "params-dora", use_dora=True), "through target_parameters")):
        with pytest.raises(AdapterError, match=match) as err:
            load_peft_adapter(adapter, dims, max_lora_rank=16)
        assert (err.value.status, err.value.code) == (400, "unsupported_adapter_feature")


def _magnitude(rng: random.Random, g: torch.Generator, out: int) -> torch.Tensor | None:
    """DoRA's magnitude [out] for a router / shared-gate module, on 40% of them (None: plain LoRA)."""
    return torch.rand(out, generator=g) * 2 + 0.5 if rng.random() < 0.4 else None


def _random_expert_adapter(rng: random.Random, tag: str, shared_gate: bool = False) -> LoRAAdapter:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    experts = {}
    for layer in range(DIMS.num_layers):
        if rng.random() < 0.5:   # the router (expert -1), with DoRA's magnitude at times
            r = rng.randint(1, 4)
            experts[(layer, -1, "gate")] = LoRAModule(torch.randn(r, 16, generator=g), torch.randn(3, r, generator=g),
                                                      rng.uniform(0.5, 2), _magnitude(rng, g, 3))
        if shared_gate and rng.random() < 0.6:   # the shared expert's gate (expert -1, one output)
            r = rng.randint(1, 4)
            experts[(layer, -1, "shared_expert_gate")] = LoRAModule(
                torch.randn(r, 16, generator=g), torch.randn(1, r, generator=g), rng.uniform(0.5, 2),
                _magnitude(rng, g, 1))
        for e in rng.sample(range(DIMS.num_experts), rng.randint(1, DIMS.num_experts)):
            for proj in rng.sample(["gate_proj", "up_proj", "down_proj"], rng.randint(1, 3)):
                r = rng.randint(1, 4)
                in_f, out_f = (8, 16) if proj == "down_proj" else (16, 8)
                experts[(layer, e, proj)] = LoRAModule(torch.randn(r, in_f, generator=g),
                                                       torch.randn(out_f, r, generator=g), rng.uniform(0.5, 2))
    return LoRAAdapter(source=tag, path=tag, modules={}, expert_modules=experts)


def _expected(x: torch.Tensor, experts: Experts, weights: torch.Tensor, idx: torch.Tensor,
              token_adapters: list[LoRAAdapter | None], layer: int) -> torch.Tensor:
    """Per token, per chosen expert: the expert MLP with W + s B A folded in (a loop over rows: the reference)."""
    out = torch.zeros_like(x)
    for t, adapter in enumerate(token_adapters):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            w_gu, w_dn = experts.gate_up_proj[e].clone(), experts.down_proj[e].clone()
            mods = adapter.expert_modules if adapter is not None else {}
            for proj, rows in (("gate_proj", slice(0, 8)), ("up_proj", slice(8, 16))):
                m = mods.get((layer, e, proj))
                if m is not None:
                    w_gu[rows] += m.scaling * m.lora_b @ m.lora_a
            m = mods.get((layer, e, "down_proj"))
            if m is not None:
                w_dn += m.scaling * m.lora_b @ m.lora_a
            out[t] += weights[t, k] * (silu_and_mul(x[t] @ w_gu.t()) @ w_dn.t())
    return out


def _linear_reference(linear: torch.nn.Linear, x: torch.Tensor, token_adapters: list[LoRAAdapter | None],
                      key: tuple[int, int, str]) -> torch.Tensor:
    """linear(x) with each token's adapter's s * B A x for `key` added (a loop over tokens: the reference)."""
    want = linear(x)
    for t, adapter in enumerate(token_adapters):
        m = adapter.expert_modules.get(key) if adapter is not None else None
        if m is not None:
            want[t] += m.scaling * (m.lora_b @ (m.lora_a @ x[t]))
            if m.magnitude is not None:   # DoRA: m / ||W + s B A||_row of the folded weight (no bias here)
                want[t] *= m.magnitude / torch.linalg.norm(linear.weight + m.scaling * m.lora_b @ m.lora_a, dim=1)
    return want


@pytest.mark.parametrize(("seed", "shared"), [(0, False), (1, False), (2, True), (3, True)])
def test_expert_slots_random_operations_and_deltas(seed: int, shared: bool) -> None:
    """Loads, evictions and unloads with check_integrity() after each; the wrapper's (slot, expert)-grouped deltas
    equal the folded per-row reference for a batch mixing base rows and every loaded adapter; so do the router's
    and (`shared`: a base with a shared expert) the shared-expert gate's."""
    rng = random.Random(seed)
    pool = LoRASlotPool(3, 4, SHARED if shared else DIMS)
    assert (pool.experts.shared_gate is not None) == shared        # allocated only for a base with the gate
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                      max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                      mlp_bias=False, sliding_window=None, torch_dtype="float32", num_experts=3,
                      num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True, sparse_layers=(True, True))
    torch.manual_seed(seed)
    experts = Experts(cfg, silu_and_mul)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3)
        experts.down_proj.normal_(0, 0.3)
    routers = [torch.nn.Linear(16, 3, bias=False) for _ in range(DIMS.num_layers)]
    gates = [torch.nn.Linear(16, 1, bias=False) for _ in range(DIMS.num_layers)]
    for layer in range(DIMS.num_layers):    # DoRA's norms read the base weights, as the wrappers register them
        pool.experts.register_base(layer, "gate", routers[layer])
        if shared:
            pool.experts.register_base(layer, "shared_expert_gate", gates[layer])
    adapters = {}
    for step in range(12):
        op = rng.random()
        if op < 0.6 or not pool.loaded_ids:
            tag = f"a{step}"
            adapters[tag] = _random_expert_adapter(rng, tag, shared)
            pool.load(tag, adapters[tag])
        else:
            pool.unload_adapter(rng.choice(pool.loaded_ids))
        pool.check_integrity()
        slots = [-1] + [pool.slot_of(i) for i in pool.loaded_ids]
        token_slots = [rng.choice(slots) for _ in range(7)]
        pool.context.set_batch(token_slots)
        layer = rng.randrange(DIMS.num_layers)
        wrapper = ExpertLoRA(experts, pool.experts, pool.context, layer)
        x = torch.randn(7, 16)
        weights, idx = route(torch.randn(7, 3), 2, True, True)
        token_adapters = [None if s < 0 else adapters[pool.adapter_id_of(s)] for s in token_slots]
        with torch.no_grad():
            torch.testing.assert_close(wrapper(x, weights, idx),
                                       _expected(x, experts, weights, idx, token_adapters, layer), atol=1e-4, rtol=1e-4)
            router = routers[layer]
            torch.testing.assert_close(RouterLoRA(router, pool.experts, pool.context, layer)(x),
                                       _linear_reference(router, x, token_adapters, (layer, -1, "gate")),
                                       atol=1e-4, rtol=1e-4)
            if shared:
                gate = gates[layer]
                torch.testing.assert_close(SharedGateLoRA(gate, pool.experts, pool.context, layer)(x),
                                           _linear_reference(gate, x, token_adapters,
                                                             (layer, -1, "shared_expert_gate")), atol=1e-4, rtol=1e-4)
    assert isinstance(pool.context, LoRAContext)
    assert any(m.is_dora for a in adapters.values() for m in a.expert_modules.values())
    if shared:
        assert any(k[2] == "shared_expert_gate" for a in adapters.values() for k in a.expert_modules)


def test_shared_gate_slots_integrity_on_write_clear_and_reuse() -> None:
    """check_integrity() covers the shared-expert gate's factors, ranks and scalings: a slot written, freed and
    reused by another adapter passes; each kind of damage to its buffers is caught; a base without a shared expert
    allocates none and refuses an adapter with LoRA on the gate."""
    g = torch.Generator().manual_seed(3)

    def gate_adapter(tag: str, rank: int, scaling: float) -> LoRAAdapter:
        mods = {(layer, -1, "shared_expert_gate"): LoRAModule(torch.randn(rank, 16, generator=g),
                                                              torch.randn(1, rank, generator=g), scaling)
                for layer in range(DIMS.num_layers)}
        return LoRAAdapter(source=tag, path=tag, modules={}, expert_modules=mods)

    pool = LoRASlotPool(1, 4, SHARED)
    sg = pool.experts.shared_gate
    assert tuple(sg.a.shape) == (2, 1, 4, 16) and tuple(sg.b.shape) == (2, 1, 1, 4)   # [L, slots, R, H], [.., 1, R]
    pool.load("big", gate_adapter("big", 4, 2.0))
    pool.check_integrity()
    assert sg.ranks_host[:, 0].tolist() == [4, 4] and sg.scalings_host[:, 0].tolist() == [2.0, 2.0]
    pool.load("small", gate_adapter("small", 2, 0.5))        # evicts "big": the slot reused at a smaller rank
    pool.check_integrity()
    assert sg.ranks_host[:, 0].tolist() == [2, 2] and not bool(sg.a[:, 0, 2:].any()) and not bool(sg.b[..., 2:].any())
    for damage in (lambda: sg.a[1, 0, 3].fill_(1.0),          # a weight beyond the adapter's rank
                   lambda: sg.b[0, 0, 0, 0].add_(1.0),          # a factor that differs from the adapter's
                   lambda: sg.scalings[0, 0].fill_(9.0),        # the device scalings off their host mirror
                   lambda: sg.ranks_host[1, 0].fill_(3),        # a rank that is not the adapter's
                   lambda: sg.dora_scale[0, 0].fill_(2.0),      # a DoRA scale on a slot without DoRA
                   lambda: sg.dora_host[1, 0].fill_(True)):     # a DoRA flag the adapter does not have
        tensors = (sg.a, sg.b, sg.scalings, sg.ranks_host, sg.dora_scale, sg.dora_host)
        saved = [t.clone() for t in tensors]
        damage()
        with pytest.raises(SlotPoolIntegrityError):
            pool.check_integrity()
        for t, old in zip(tensors, saved):
            t.copy_(old)
        pool.check_integrity()
    pool.unload_adapter("small")
    pool.check_integrity()
    assert not bool(sg.a.any()) and not bool(sg.b.any()) and not bool(sg.ranks_host.any())
    plain = LoRASlotPool(1, 4, DIMS)
    assert plain.experts.shared_gate is None
    with pytest.raises(AdapterError, match="no such module"):
        plain.load("gate", gate_adapter("gate", 2, 1.0))
    plain.check_integrity()


def test_lora_on_a_layer_without_that_module_is_refused(qwen3: tuple[Path, Path], tmp_path: Path) -> None:
    """Qwen3-MoE here: layer 0 has experts only, layer 1 a dense MLP. Per-expert LoRA on the dense layer and
    dense-name gate/up/down LoRA on the experts-only layer would be served as nothing: 400 for both."""
    path, adapter_dir = qwen3
    dims = BaseModelDims.from_model_config(ModelConfig.from_path(path))
    state = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for name, key, shape_a, shape_b in (
            ("experts_on_dense", "base_model.model.model.layers.1.mlp.experts.0.gate_proj", (2, 64), (48, 2)),
            ("dense_on_experts", "base_model.model.model.layers.0.mlp.down_proj", (2, 48), (64, 2))):
        bad = tmp_path / name
        shutil.copytree(adapter_dir, bad)
        extra = {f"{key}.lora_A.weight": torch.randn(*shape_a), f"{key}.lora_B.weight": torch.randn(*shape_b)}
        if name == "dense_on_experts":   # the experts-only layer's shape: qwen3's dense width is 96
            extra = {f"{key}.lora_A.weight": torch.randn(2, 96), f"{key}.lora_B.weight": torch.randn(64, 2)}
        save_file({**state, **extra}, str(bad / "adapter_model.safetensors"))
        cfg = json.loads((bad / "adapter_config.json").read_text())
        cfg["r"], cfg["lora_alpha"] = 2, 4
        cfg["rank_pattern"] = {"q_proj": 4, r"experts\.(gate_up|down)_proj": 4}   # PEFT: the parameter's path
        (bad / "adapter_config.json").write_text(json.dumps(cfg))
        with pytest.raises(AdapterError, match="no such MoE layer|no dense MLP") as err:
            load_peft_adapter(bad, dims, max_lora_rank=16)
        assert err.value.status == 400, name


def test_messages_name_the_dense_key_on_a_base_without_a_shared_expert(qwen3: tuple[Path, Path],
                                                                         tmp_path: Path) -> None:
    """Dense-name MLP keys on a sparse layer are Qwen2-MoE's shared expert only where the base has one: on
    Qwen3-MoE (and Mixtral) a message named `mlp.shared_expert.down_proj`, a module neither in the file nor in the
    model."""
    path, adapter_dir = qwen3
    dims = BaseModelDims.from_model_config(ModelConfig.from_path(path))
    assert not dims.shared_expert
    bad = tmp_path / "dense_on_experts"
    shutil.copytree(adapter_dir, bad)
    key = "base_model.model.model.layers.0.mlp.down_proj"
    state = load_file(str(adapter_dir / "adapter_model.safetensors"))
    save_file({**state, f"{key}.lora_A.weight": torch.randn(4, 40), f"{key}.lora_B.weight": torch.randn(64, 4)},
              str(bad / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"model\.layers\.0\.mlp\.down_proj") as err:
        load_peft_adapter(bad, dims, max_lora_rank=16)
    assert err.value.status == 400 and "shared_expert" not in err.value.message
