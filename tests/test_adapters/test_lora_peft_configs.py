"""PEFT config options a tenant's adapter may carry: each served as `PeftModel` computes it (greedy fp32 token for
token) or refused at load with a 400 naming the reason. The weights must cover exactly the modules the config
targets, by PEFT's own rules (target_modules as names or a regex, exclude_modules, layers_to_transform /
layers_pattern): PEFT ignores weights of a module it does not target and gives a targeted module without weights its
initial LoRA, so serving such files as saved would differ from PEFT."""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from adapters.errors import AdapterError  # noqa: E402
from adapters.layers.dims import BaseModelDims  # noqa: E402
from adapters.peft.loader import load_peft_adapter  # noqa: E402
from core.config import ModelConfig  # noqa: E402
from lora_fixtures import _fresh_base, _save_adapter  # noqa: E402
from lora_tree import check_served_as_peft  # noqa: E402
from moe_adapters import expert_params_adapter  # noqa: E402
from moe_models import moe_dir  # noqa: E402
from testlib import PROMPTS, model_dir  # noqa: E402

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_TOKENS = 6


def save(path: Path, out: Path, seed: int = 5, b_mult: float = 1.0, **kwargs) -> Path:
    kwargs.setdefault("r", 4)
    kwargs.setdefault("lora_alpha", 8)
    return _save_adapter(_fresh_base(str(path)), kwargs, b_mult, seed, out)


def edit_weights(src: Path, out: Path, edit) -> Path:
    shutil.copytree(src, out)
    state = load_file(str(out / "adapter_model.safetensors"))
    edit(state)
    save_file(state, str(out / "adapter_model.safetensors"))
    return out


def expect_400(path: Path, dims: BaseModelDims, code: str, match: str) -> AdapterError:
    with pytest.raises(AdapterError, match=match) as err:
        load_peft_adapter(path, dims, max_lora_rank=16)
    assert (err.value.status, err.value.code) == (400, code)
    return err.value


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BaseModelDims, Path]:
    path = model_dir("llama_gqa")
    dims = BaseModelDims.from_model_config(ModelConfig.from_path(path))
    return path, dims, tmp_path_factory.mktemp("configs")


def test_weights_of_modules_the_config_does_not_target_are_refused(llama) -> None:
    path, dims, tmp = llama
    qv = save(path, tmp / "qv", target_modules=["q_proj", "v_proj"])
    ltt = save(path, tmp / "ltt", target_modules=["q_proj"], layers_to_transform=[1], layers_pattern="layers")
    rx = save(path, tmp / "rx", target_modules=r".*layers\.1\.self_attn\.(q|v)_proj")
    ex = save(path, tmp / "ex", target_modules=ALL7, exclude_modules=["model.layers.0.self_attn.q_proj", "down_proj"])
    gen = torch.Generator().manual_seed(1)
    k_proj = {"base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": torch.randn(4, 64, generator=gen),
              "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight": torch.randn(32, 4, generator=gen)}

    def copy_layer(state: dict, key: str, src: str, dst: str) -> None:
        for ab in ("A", "B"):
            state[key.format(dst, ab)] = state[key.format(src, ab)].clone()

    q_key = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"
    down_key = "base_model.model.model.layers.{}.mlp.down_proj.lora_{}.weight"
    for name, src, edit in (
            ("extra-k", qv, lambda s: s.update(k_proj)),            # PEFT ignores them: served, they would count
            ("extra-rx", rx, lambda s: s.update(k_proj)),
            ("extra-layer", ltt, lambda s: copy_layer(s, q_key, 1, 0)),
            ("excluded", ex, lambda s: copy_layer(s, q_key, 1, 0)),
            ("excluded-down", ex, lambda s: s.update({down_key.format(0, ab): torch.randn(*shape, generator=gen)
                                                      for ab, shape in (("A", (4, 128)), ("B", (64, 4)))}))):
        bad = edit_weights(src, tmp / name, edit)
        err = expect_400(bad, dims, "invalid_adapter", "does not target")
        assert "PEFT would ignore them" in str(err) and str(tmp) not in str(err)
    for good in (qv, ltt, rx, ex):
        load_peft_adapter(good, dims, max_lora_rank=16)


def test_a_targeted_module_without_weights_is_refused(llama) -> None:
    path, dims, tmp = llama
    qv = save(path, tmp / "qv-missing", target_modules=["q_proj", "v_proj"])

    def drop(sub: str):
        return lambda s: [s.pop(k) for k in [k for k in s if sub in k]]

    one = edit_weights(qv, tmp / "no-v1", drop("layers.1.self_attn.v_proj"))
    expect_400(one, dims, "adapter_shape_mismatch", r"targets model\.layers\.1\.self_attn\.v_proj but the adapter "
                                                    "has no LoRA weights")
    every = edit_weights(qv, tmp / "no-v", drop("v_proj"))
    expect_400(every, dims, "adapter_shape_mismatch", "v_proj but the adapter has no LoRA weights")
    cfg = json.loads((every / "adapter_config.json").read_text())
    (every / "adapter_config.json").write_text(json.dumps({**cfg, "init_lora_weights": True}))
    expect_400(every, dims, "adapter_shape_mismatch", "no LoRA weights")      # missing is missing, whatever the init
    vocab = save(path, tmp / "vocab-missing", target_modules=["q_proj", "lm_head"])
    expect_400(edit_weights(vocab, tmp / "no-head", drop("lm_head")), dims, "adapter_shape_mismatch",
               "targets lm_head")


def test_config_options_are_served_as_peft(llama) -> None:
    """Options that change which modules get LoRA, with which rank and scale, and how the files are saved."""
    path, _, tmp = llama
    adapters = {
        "patterns": save(path, tmp / "patterns", r=8, target_modules=ALL7, use_rslora=True,
                         rank_pattern={r"layers\.[01]\.self_attn\.(q|k)_proj": 2, ".*mlp.*": 6},
                         alpha_pattern={"^model.*o_proj": 2.5, r"1\.mlp\.gate_proj": 40, "self_attn.v_proj": 3}),
        "exclude": save(path, tmp / "exclude", target_modules=ALL7, exclude_modules=r".*layers\.1\.mlp.*"),
        "layers": save(path, tmp / "layers", target_modules=["q_proj", "o_proj", "layers.1.mlp.down_proj"],
                       layers_to_transform=0, layers_pattern=["layers"], seed=7, b_mult=1.5),
        "regex": save(path, tmp / "regex", target_modules=r".*\.(k_proj|up_proj)", seed=8, b_mult=1.5),
        "all-linear": save(path, tmp / "all-linear", target_modules="all-linear", seed=9),
    }
    half = tmp / "fp16-newer-peft"       # saved in fp16 by a newer peft (unknown config keys), .bin weights
    shutil.copytree(adapters["regex"], half)
    state = {k: v.half() for k, v in load_file(str(half / "adapter_model.safetensors")).items()}
    torch.save(state, str(half / "adapter_model.bin"))
    (half / "adapter_model.safetensors").unlink()
    cfg = json.loads((half / "adapter_config.json").read_text())
    (half / "adapter_config.json").write_text(json.dumps({**cfg, "peft_version": "9.0.0", "some_future_option": 1}))
    adapters["fp16-bin"] = half
    check_served_as_peft(path, adapters, [PROMPTS[2], PROMPTS[7]], MAX_TOKENS)


def test_rank_and_alpha_patterns_on_a_shared_expert_match_peft(tmp_path: Path) -> None:
    """Qwen2-MoE's shared expert: PEFT's patterns match its own name (`mlp.shared_expert.down_proj`), which the
    loader's renamed keys once hid (the pattern silently ignored: another scale than PEFT's)."""
    path = moe_dir("qwen2_moe")
    adapter = save(path, tmp_path / "shared", r=4, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"],
                   alpha_pattern={"shared_expert.down_proj": 80}, rank_pattern={"layers.1.mlp.shared_expert.up_proj": 2},
                   seed=3)
    dims = BaseModelDims.from_model_config(ModelConfig.from_path(path))
    ad = load_peft_adapter(adapter, dims, max_lora_rank=16)
    assert ad.module(1, "up_proj").rank == 2 and ad.module(0, "down_proj").scaling == pytest.approx(80 / 4)
    check_served_as_peft(path, {"shared": adapter}, [PROMPTS[2]], MAX_TOKENS)


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_a_pickled_bin_is_never_unpickled_beyond_tensors(llama) -> None:
    path, dims, tmp = llama
    evil = tmp / "evil"
    shutil.copytree(save(path, tmp / "for-bin", target_modules=["q_proj"]), evil)
    (evil / "adapter_model.safetensors").unlink()
    marker = tmp / "pwned"
    with open(evil / "adapter_model.bin", "wb") as f:
        pickle.dump({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": _RunsCode(marker)}, f)
    err = expect_400(evil, dims, "corrupt_adapter_weights", "adapter_model.bin: not a plain state dict of tensors")
    assert not marker.exists() and "weights_only" not in str(err)


def test_targeted_modules_without_weights_are_refused_on_moe_bases(tmp_path: Path) -> None:
    """Two gaps of the missing-weights check: Qwen2-MoE's shared expert (`mlp.shared_expert.down_proj`, targeted by
    `down_proj`) was not among the modules checked, and an adapter with only experts' weights was never checked
    (a config targeting q_proj with no q_proj weights loaded; PEFT would give q_proj its initial LoRA)."""
    qwen2 = moe_dir("qwen2_moe")
    dims = BaseModelDims.from_model_config(ModelConfig.from_path(qwen2))
    sparse = next(layer for layer in range(dims.num_layers) if dims.is_sparse_layer(layer))
    shared = save(qwen2, tmp_path / "shared", target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    load_peft_adapter(shared, dims, max_lora_rank=16)
    no_shared_down = edit_weights(shared, tmp_path / "no-shared-down", lambda s: [
        s.pop(k) for k in [k for k in s if f"layers.{sparse}.mlp.shared_expert.down_proj" in k]])
    expect_400(no_shared_down, dims, "adapter_shape_mismatch",
               rf"targets model\.layers\.{sparse}\.mlp\.shared_expert\.down_proj but the adapter has no LoRA weights")
    qwen3 = moe_dir("qwen3_moe")
    dims3 = BaseModelDims.from_model_config(ModelConfig.from_path(qwen3))
    experts = expert_params_adapter(qwen3, tmp_path / "experts", ["experts.gate_up_proj", "experts.down_proj"],
                                    ["q_proj"], 4, 8, 1.0, 71)
    load_peft_adapter(experts, dims3, max_lora_rank=16)
    experts_only = edit_weights(experts, tmp_path / "experts-only", lambda s: [
        s.pop(k) for k in [k for k in s if "q_proj" in k]])
    expect_400(experts_only, dims3, "adapter_shape_mismatch", r"targets model\.layers\.0\.self_attn\.q_proj but")


@pytest.mark.parametrize("spelling", ["all-linear", "ALL-Linear"])
def test_a_hand_written_all_linear_config_loads_and_missing_weights_under_it_are_refused(llama, spelling) -> None:
    """peft expands "all-linear" into the names when it saves; a hand-written config may keep the shorthand (any
    case, as peft reads it): every linear but the LM head, so the seven projections' weights load and an adapter
    missing one of them is refused."""
    path, dims, tmp = llama
    tag = spelling.lower().replace("-", "_") + spelling[0]
    all7 = save(path, tmp / f"all7-{tag}", target_modules=ALL7)

    def shorthand(src: Path) -> Path:
        cfg = json.loads((src / "adapter_config.json").read_text())
        (src / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": spelling}))
        return src

    ad = load_peft_adapter(shorthand(all7), dims, max_lora_rank=16)
    assert {name for _, name in ad.modules} == set(ALL7)
    no_v = edit_weights(all7, tmp / f"all-linear-no-v-{tag}",
                        lambda s: [s.pop(k) for k in [k for k in s if "layers.1.self_attn.v_proj" in k]])
    expect_400(no_v, dims, "adapter_shape_mismatch", r"targets model\.layers\.1\.self_attn\.v_proj but the adapter")
    head = save(path, tmp / f"head-{tag}", target_modules=ALL7 + ["lm_head"])
    expect_400(shorthand(head), dims, "invalid_adapter", "lm_head, which adapter_config.json does not target")


_MATRIX_KEYS = [
    "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj", "model.layers.12.mlp.down_proj",
    "model.layers.1.mlp.shared_expert.up_proj", "model.layers.1.mlp.experts.0.gate_proj",
    "model.language_model.layers.0.self_attn.q_proj", "model.embed_tokens", "lm_head",
    "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj", "transformer.h.2.attn.q_proj",
    "q_proj", "model.layers.0.self_attn.q_projx", "model.layers.0.self_attn.xq_proj",
]
_MATRIX_CONFIGS = [
    dict(target_modules=["q_proj", "v_proj"]),
    dict(target_modules=["q_proj", "down_proj", "lm_head", "embed_tokens"]),
    dict(target_modules=["model.layers.0.self_attn.q_proj", "layers.1.self_attn.v_proj", "shared_expert.up_proj"]),
    dict(target_modules=r".*\.(q_proj|v_proj)"),
    dict(target_modules=r"(.*\.)?(q_proj|down_proj)"),
    dict(target_modules=r".*\.layers\.\d+\.(self_attn|mlp)\.(q_proj|v_proj)$"),
    dict(target_modules=r"model\.language_model.*\.(q_proj|k_proj)"),
    dict(target_modules=ALL7, exclude_modules=["model.layers.0.self_attn.q_proj", "down_proj"]),
    dict(target_modules=ALL7, exclude_modules=r".*layers\.1\..*"),
    dict(target_modules=ALL7, exclude_modules=r".*vision_tower.*"),
    dict(target_modules=ALL7, layers_to_transform=[0, 12]),
    dict(target_modules=ALL7, layers_to_transform=1, layers_pattern="layers"),
    dict(target_modules=ALL7, layers_to_transform=[0, 2], layers_pattern=["h", "layers"]),
    dict(target_modules=ALL7, layers_to_transform=[0], layers_pattern="encoder.layers"),
    dict(target_modules=["q_proj", "gate_proj"], layers_to_transform=[]),
    dict(target_modules=None, target_parameters=["mlp.experts.gate_up_proj"]),
]


@pytest.mark.parametrize("raw", _MATRIX_CONFIGS, ids=[str(i) for i in range(len(_MATRIX_CONFIGS))])
def test_targets_agree_with_peft(raw) -> None:
    """PeftLoRAConfig.targets() is peft's check_target_module_exists, whatever the config and the module path."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    from adapters.peft.config import parse_peft_config

    cfg, peft_cfg = parse_peft_config(raw), LoraConfig(**raw)
    for key in _MATRIX_KEYS:
        ours = cfg.targets(key)
        if ours is not None:
            assert ours == bool(check_target_module_exists(peft_cfg, key)), key


@pytest.mark.parametrize(("family", "targets"), [("qwen3_moe", ALL7), ("mixtral", "all-linear")])
def test_moe_adapters_peft_saves_for_transformers_5_are_served_as_peft(tmp_path: Path, family: str, targets) -> None:
    """peft 0.21 turns gate/up/down on a transformers-5 MoE into `target_parameters` named bare (`gate_up_proj`,
    `down_proj`; Mixtral's all-linear also the router's `gate.weight`) with the fused tensor's rank doubled through
    a rank_pattern matched against the parameter's path (`.*\\.gate_up_proj`). Both were refused ("unsupported
    target parameter 'gate_up_proj'"); served as PEFT, greedy token for token."""
    path = moe_dir(family)
    adapter = save(path, tmp_path / family, target_modules=targets, seed=11, b_mult=2.0)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert {"gate_up_proj", "down_proj"} <= set(cfg["target_parameters"]), cfg   # the layout under test
    dims = BaseModelDims.from_model_config(ModelConfig.from_path(path))
    ad = load_peft_adapter(adapter, dims, max_lora_rank=16)
    assert {p for _, _, p in ad.expert_modules} >= {"gate_proj", "up_proj", "down_proj"}
    assert ("gate.weight" in cfg["target_parameters"]) == (family == "mixtral") == any(
        e == -1 for _, e, _ in ad.expert_modules)                                  # the router's LoRA
    check_served_as_peft(path, {family: adapter}, [PROMPTS[2], PROMPTS[7]], MAX_TOKENS)


def test_vision_tower_lora_of_a_multimodal_base_is_skipped(tmp_path: Path) -> None:
    """A plain `q_proj` target puts LoRA on Gemma 3's vision tower too (`vision_tower...encoder.layers.N.
    self_attn.q_proj`): the adapter was refused as a "duplicate LoRA A weight for model.language_model.layers.0...".
    The server takes text only, so the tower's LoRA never reaches an output: skipped, served as PEFT on text."""
    from family_models import gemma3_multimodal_dir

    path = gemma3_multimodal_dir()
    adapter = save(path, tmp_path / "gemma3-qv", target_modules=["q_proj", "v_proj"], seed=13, b_mult=2.0)
    assert any("vision_tower" in k for k in load_file(str(adapter / "adapter_model.safetensors")))
    ad = load_peft_adapter(adapter, BaseModelDims.from_model_config(ModelConfig.from_path(path)), max_lora_rank=16)
    assert {name for _, name in ad.modules} == {"q_proj", "v_proj"}
    check_served_as_peft(path, {"gemma3-qv": adapter}, [PROMPTS[2], PROMPTS[7]], MAX_TOKENS)
