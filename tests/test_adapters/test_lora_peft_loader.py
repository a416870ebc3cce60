"""peft_loader validation: every rejection is an AdapterError with a status and a reason."""

import copy
import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from adapters.layers.dims import BaseModelDims  # noqa: E402
from adapters.errors import AdapterError  # noqa: E402
from adapters.peft.config import parse_peft_config  # noqa: E402
from adapters.peft.loader import load_peft_adapter  # noqa: E402

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
                                   vocab_size=64, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).eval(), BaseModelDims.from_hf_config(cfg)


def save_peft(base_model, path, safe=True, **kw):
    kw.setdefault("r", 8)
    kw.setdefault("target_modules", ALL7)
    pm = peft.get_peft_model(copy.deepcopy(base_model), peft.LoraConfig(init_lora_weights=False, **kw))
    pm.save_pretrained(path, safe_serialization=safe)
    return path


@pytest.fixture(scope="module")
def good_dir(base, tmp_path_factory):
    return save_peft(base[0], tmp_path_factory.mktemp("good"))


def clone(src, tmp_path):
    dst = tmp_path / "adapter"
    shutil.copytree(src, dst)
    return dst


def edit_config(path, **changes):
    cfg_path = path / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))


def expect_error(path, dims, status=400, code=None, match=None, max_rank=64, **kw):
    with pytest.raises(AdapterError) as info:
        load_peft_adapter(path, dims, max_rank, **kw)
    err = info.value
    assert err.status == status, err
    if code:
        assert err.code == code, err
    if match:
        assert match.lower() in err.message.lower(), err
    return err


def test_good_adapter_loads(base, good_dir):
    ad = load_peft_adapter(str(good_dir), base[1], 64)
    assert len(ad.modules) == 14 and ad.max_rank == 8
    assert ad.module(0, "q_proj").lora_a.shape == (8, 32)
    assert ad.module(1, "down_proj").lora_b.shape == (32, 8)


def test_bin_weights_load_like_safetensors(base, good_dir, tmp_path):
    path = clone(good_dir, tmp_path)
    state = load_file(path / "adapter_model.safetensors")
    (path / "adapter_model.safetensors").unlink()
    torch.save(state, path / "adapter_model.bin")
    ad = load_peft_adapter(path, base[1], 64)
    ref = load_peft_adapter(good_dir, base[1], 64)
    for key, mod in ref.modules.items():
        assert torch.equal(ad.modules[key].lora_a, mod.lora_a)
        assert torch.equal(ad.modules[key].lora_b, mod.lora_b)
    (path / "adapter_model.bin").write_bytes(b"\x80\x02garbage")
    expect_error(path, base[1], code="corrupt_adapter_weights")


def test_missing_paths_are_404(base, tmp_path):
    expect_error(tmp_path / "does-not-exist", base[1], status=404, code="adapter_not_found")
    expect_error("./nope/adapter", base[1], status=404)
    expect_error("no-such-org/no-such-adapter-xyz", base[1], status=404, allow_download=False)


def test_dir_without_files(base, good_dir, tmp_path):
    expect_error(tmp_path, base[1], match="adapter_config.json")
    path = clone(good_dir, tmp_path)
    (path / "adapter_model.safetensors").unlink()
    expect_error(path, base[1], match="adapter_model")
    (path / "adapter_config.json").write_text("{not json")
    expect_error(path, base[1], match="adapter_config.json")


@pytest.mark.parametrize("mode", ["garbage", "truncated"])
def test_corrupt_safetensors(base, good_dir, tmp_path, mode):
    path = clone(good_dir, tmp_path)
    f = path / "adapter_model.safetensors"
    data = f.read_bytes()
    f.write_bytes(b"this is not safetensors" * 10 if mode == "garbage" else data[: len(data) // 2])
    expect_error(path, base[1], code="corrupt_adapter_weights")


def test_rank_too_large(base, good_dir):
    expect_error(good_dir, base[1], max_rank=4, code="lora_rank_too_large", match="rank 8")


def test_wrong_base_shapes(base, good_dir):
    dims = base[1]
    wider = BaseModelDims(**{**dims.__dict__, "hidden_size": 64})
    expect_error(good_dir, wider, code="adapter_shape_mismatch")
    fewer_kv = BaseModelDims(**{**dims.__dict__, "num_kv_heads": 1})
    expect_error(good_dir, fewer_kv, code="adapter_shape_mismatch", match="k_proj")
    one_layer = BaseModelDims(**{**dims.__dict__, "num_layers": 1})
    expect_error(good_dir, one_layer, code="adapter_shape_mismatch", match="layer 1")


def test_dora_loads_with_its_magnitudes(base, tmp_path):
    path = save_peft(base[0], tmp_path / "dora", use_dora=True, target_modules=["q_proj", "down_proj", "lm_head"])
    adapter = load_peft_adapter(path, base[1], 64)
    assert adapter.has_dora and {name for _, name in adapter.modules} == {"q_proj", "down_proj"}
    for (layer, name), mod in adapter.modules.items():
        assert mod.is_dora and tuple(mod.magnitude.shape) == (base[1].module_shape(name)[1],)
    assert adapter.vocab_modules["lm_head"].is_dora
    edit_config(path, use_dora=False)  # config lies: the magnitude vectors give it away
    expect_error(path, base[1], code="invalid_adapter", match="use_dora")


def test_dora_without_magnitudes_and_bad_magnitudes(base, tmp_path):
    path = save_peft(base[0], tmp_path / "dora", use_dora=True, target_modules=["q_proj"])
    state = load_file(path / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    mag = state.pop(key)
    save_file(state, path / "adapter_model.safetensors")
    expect_error(path, base[1], code="corrupt_adapter_weights", match="magnitude")
    for bad, code in [(mag[:-1], "adapter_shape_mismatch"), (mag.reshape(4, -1), "corrupt_adapter_weights"),
                      (torch.full_like(mag, float("nan")), "corrupt_adapter_weights")]:
        save_file({**state, key: bad.contiguous()}, path / "adapter_model.safetensors")
        expect_error(path, base[1], code=code)


def test_dora_on_embeddings_is_a_clear_400(base, tmp_path):
    path = save_peft(base[0], tmp_path / "dora-emb", use_dora=True, target_modules=["q_proj", "embed_tokens"])
    expect_error(path, base[1], code="unsupported_adapter_feature", match="DoRA on the embeddings")
    assert str(tmp_path) not in _message(path, base[1])


def _message(path, dims):
    with pytest.raises(AdapterError) as info:
        load_peft_adapter(path, dims, 64)
    return info.value.message


def test_embedding_and_lm_head_lora_load_in_peft_layout(base, tmp_path):
    path = save_peft(base[0], tmp_path / "vocab", r=4, target_modules=["q_proj", "embed_tokens", "lm_head"])
    state = load_file(path / "adapter_model.safetensors")
    assert "base_model.model.model.embed_tokens.base_layer.weight" in state   # PEFT saves the base table too
    adapter = load_peft_adapter(path, base[1], 64)
    emb, head = adapter.vocab_modules["embed_tokens"], adapter.vocab_modules["lm_head"]
    assert tuple(emb.lora_a.shape) == (4, 64) and tuple(emb.lora_b.shape) == (32, 4)     # A [r, vocab], B [hidden, r]
    assert tuple(head.lora_a.shape) == (4, 32) and tuple(head.lora_b.shape) == (64, 4)
    assert torch.equal(emb.lora_a, state["base_model.model.model.embed_tokens.lora_embedding_A"])
    assert not adapter.has_dora and adapter.max_rank == 4
    state["base_model.model.model.embed_tokens.base_layer.weight"] = torch.zeros(66, 32)   # resized table
    save_file(state, path / "adapter_model.safetensors")
    expect_error(path, base[1], code="unsupported_adapter_feature", match="resized")


def test_modules_to_save_rejected(base, tmp_path):
    path = save_peft(base[0], tmp_path / "mts", target_modules=["q_proj"], modules_to_save=["lm_head"])
    expect_error(path, base[1], code="unsupported_adapter_feature", match="modules_to_save")
    edit_config(path, modules_to_save=None)
    expect_error(path, base[1], match="lm_head")


def test_unsupported_targets_and_features(base, good_dir, tmp_path):
    path = clone(good_dir, tmp_path)
    edit_config(path, target_modules=["q_proj", "score"])
    expect_error(path, base[1], code="unsupported_target_modules", match="score")
    shutil.copy(good_dir / "adapter_config.json", path / "adapter_config.json")
    for change, match in [
        (dict(bias="all"), "bias"),
        (dict(peft_type="IA3"), "peft_type"),
        (dict(init_lora_weights="pissa"), "pissa"),
        (dict(trainable_token_indices=[1, 2]), "tokens"),
        (dict(lora_bias=True), "bias"),
    ]:
        edit_config(path, **change)
        expect_error(path, base[1], code="unsupported_adapter_feature", match=match)
        shutil.copy(good_dir / "adapter_config.json", path / "adapter_config.json")


@pytest.mark.parametrize("field", ["velora_config", "monteclora_config", "use_bdlora", "arrow_config", "kasa_config"])
def test_an_empty_variant_sub_config_is_refused(base, good_dir, tmp_path, field):
    """peft turns a variant's sub-config into its dataclass whenever it is not null, so `{}` switches the variant
    on with its defaults (KaSA, BD-LoRA, ...): it was read as "off" and served as plain LoRA."""
    path = clone(good_dir, tmp_path)
    edit_config(path, **{field: {}})
    expect_error(path, base[1], code="unsupported_adapter_feature", match="not supported")
    edit_config(path, **{field: None})
    load_peft_adapter(path, base[1], 64)


def test_resized_embeddings_and_added_tokens(base, good_dir, tmp_path):
    path = clone(good_dir, tmp_path)
    state = load_file(path / "adapter_model.safetensors")
    state["base_model.model.model.embed_tokens.weight"] = torch.zeros(66, 32)  # vocab 64 -> 66
    save_file(state, path / "adapter_model.safetensors")
    expect_error(path, base[1], code="unsupported_adapter_feature", match="resized")
    path2 = tmp_path / "tok"
    shutil.copytree(good_dir, path2)
    (path2 / "added_tokens.json").write_text(json.dumps({"<new>": 64}))
    expect_error(path2, base[1], code="unsupported_adapter_feature", match="added tokens")


def test_inconsistent_weights(base, good_dir, tmp_path):
    path = clone(good_dir, tmp_path)
    state = load_file(path / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    state.pop(key)
    save_file(state, path / "adapter_model.safetensors")
    expect_error(path, base[1], match="lora_a without lora_b")
    path2 = tmp_path / "rank"
    shutil.copytree(good_dir, path2)
    edit_config(path2, r=4)  # weights are rank 8
    expect_error(path2, base[1], code="adapter_shape_mismatch", match="config says 4")


def test_lora_a_and_b_of_different_ranks_say_so(base, good_dir, tmp_path):
    """benchmarks/many_adapters.py once wrote lora_A [32, 4096] beside lora_B [4096, 31] (B's columns cut short):
    the server refused it, rightly, but blamed the base model; the message names the two ranks."""
    path = clone(good_dir, tmp_path)
    state = load_file(path / "adapter_model.safetensors")
    key = next(k for k in state if "layers.1.self_attn.q_proj.lora_B" in k)
    state[key] = state[key][:, :-1].contiguous()                      # [32, 7] beside lora_A [8, 32]
    save_file(state, str(path / "adapter_model.safetensors"))
    err = expect_error(path, base[1], code="adapter_shape_mismatch", match="layers.1.self_attn.q_proj")
    assert "lora_A has rank 8, lora_B rank 7" in err.message and "different base model" not in err.message, err


def test_weight_keys_in_messages_show_no_path_and_stay_bounded(base, good_dir, tmp_path):
    """A message names a module by its weights' key: the file author's text, which reaches the tenant who asked
    for the adapter. A key carrying a path (or a megabyte of text) shows no '/' and at most 160 characters."""
    path = clone(good_dir, tmp_path)
    state = load_file(path / "adapter_model.safetensors")
    long = {"/srv/loras/globex/secret-adapter." + "x" * 5000 + "." + k: v for k, v in state.items()}
    save_file(long, str(path / "adapter_model.safetensors"))   # longer than any real weight's name: refused
    err = expect_error(path, base[1], code="unsupported_target_modules", match="longer than")
    assert "srv/loras" not in err.message and len(err.message) < 400, err
    prefix = "/srv/loras/globex/secret-adapter." + "x" * 100 + "."
    state = {(prefix + k if "layers.0.self_attn.q_proj" in k else k): v for k, v in state.items()}
    key = next(k for k in state if k.startswith(prefix) and "lora_A" in k)
    state[key] = torch.zeros(8, 31)                                   # lora_A [8, 31]: not the base's hidden 32
    save_file(state, str(path / "adapter_model.safetensors"))
    err = expect_error(path, base[1], code="adapter_shape_mismatch", match="layers.0.self_attn.q_proj")
    assert "/" not in err.message.split(":")[0] and "srv" not in err.message and len(err.message) < 400, err
    state[prefix + "layers.0.self_attn.rotary.lora_A.weight"] = torch.zeros(8, 32)   # an unsupported weight
    save_file(state, str(path / "adapter_model.safetensors"))
    err = expect_error(path, base[1], code="unsupported_target_modules")
    assert "srv/loras" not in err.message and "globex/" not in err.message and len(err.message) < 400, err
    edit_config(path, peft_type="/srv/loras/globex/IA3")
    err = expect_error(path, base[1], code="unsupported_adapter_feature")
    assert "srv/loras" not in err.message.lower(), err


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"r": ' + "[" * 100_000 + "]" * 100_000 + "}"])
def test_deeply_nested_json_is_a_400(base, good_dir, tmp_path, text):
    """An adapter_config.json (or added_tokens.json) nested past the parser's recursion limit raised
    RecursionError through the loader: the admin load answered 500, not the 400 of any other unreadable config."""
    path = clone(good_dir, tmp_path)
    (path / "adapter_config.json").write_text(text)
    expect_error(path, base[1], code="invalid_adapter", match="adapter_config.json")
    shutil.copy(good_dir / "adapter_config.json", path / "adapter_config.json")
    (path / "added_tokens.json").write_text(text)
    expect_error(path, base[1], code="unsupported_adapter_feature", match="added tokens")


@pytest.mark.parametrize("change", [dict(lora_alpha=float("nan")), dict(lora_alpha=float("inf")),
                                    dict(lora_alpha="-inf"), dict(alpha_pattern={"q_proj": float("nan")})])
def test_non_finite_alpha_is_a_400(base, good_dir, tmp_path, change):
    """A NaN or infinite lora_alpha (Python's JSON reader takes NaN / Infinity, float() takes "inf") made a NaN or
    infinite scaling: the adapter loaded, and every request naming it got NaN logits."""
    path = clone(good_dir, tmp_path)
    edit_config(path, **change)
    expect_error(path, base[1], code="invalid_adapter", match="finite")


@pytest.mark.parametrize("part, value", [("lora_B", float("nan")), ("lora_A", float("-inf"))])
def test_non_finite_weights_are_a_400(base, good_dir, tmp_path, part, value):
    """A NaN or infinite LoRA weight loaded (only DoRA's magnitudes were checked), and every request naming the
    adapter got NaN logits: empty text."""
    path = clone(good_dir, tmp_path)
    state = load_file(path / "adapter_model.safetensors")
    key = next(k for k in sorted(state) if f".{part}." in k)
    state[key] = state[key].clone()
    state[key].view(-1)[3] = value
    save_file(state, path / "adapter_model.safetensors")
    expect_error(path, base[1], code="corrupt_adapter_weights", match="non-finite")


CATASTROPHIC = r"(?:[a-z_.0-9]|[a-z_.0-9])*Z"     # exponential backtracking: minutes on one module path


@pytest.mark.parametrize("change", [
    dict(target_modules=CATASTROPHIC), dict(exclude_modules=CATASTROPHIC), dict(layers_pattern=CATASTROPHIC),
    dict(target_modules=ALL7, layers_to_transform=[0], layers_pattern=["layers", CATASTROPHIC]),
    dict(rank_pattern={CATASTROPHIC: 8}), dict(alpha_pattern={"q_proj": 4, CATASTROPHIC: 8}),
    dict(target_modules=r"(a+)+b"), dict(target_modules=r".*.*.*.*\.q_proj"), dict(exclude_modules="x" * 600),
    dict(target_modules=r"(?:.*\.q_proj|.*a.*b.*c.*d)"), dict(target_modules=r".*(?=.*.*.*x).*"),
    dict(rank_pattern={r".*a.*b.*c": 8}), dict(target_modules=r".*a.*b.*c.*(?:x|y)"),
    dict(target_modules=ALL7 + [f"m{i}.q_proj" for i in range(930_000)]),
    dict(exclude_modules=[f"m{i}.q_proj" for i in range(930_000)]),
    dict(layers_to_transform=list(range(930_000)), layers_pattern="layers"),
    dict(rank_pattern={f"m{i}": 8 for i in range(100_000)}),
])
def test_costly_config_patterns_and_lists_are_refused_fast(base, good_dir, tmp_path, change):
    """Adapters load in the engine process: a tenant's config regex that backtracks badly (Python's `re`, holding
    the GIL, minutes on one module path) or a list of a million names scanned for each of the ~450 modules checked
    (~40 s a load) is a 400 naming the field, in well under a second."""
    path = clone(good_dir, tmp_path)
    edit_config(path, **change)
    start = time.perf_counter()
    err = expect_error(path, base[1], code="invalid_adapter")
    assert time.perf_counter() - start < 0.5 + 2e-6 * len(json.dumps(change))   # + reading the JSON
    assert any(field in err.message for field in change if field != "target_modules" or len(change) == 1), err


@pytest.mark.parametrize("targets", [r".*\.(q_proj|v_proj)", r"(.*\.)?(q_proj|v_proj)",
                                     r".*\.layers\.\d+\.(self_attn|mlp)\.(q_proj|v_proj)$"])
def test_real_peft_patterns_still_load(base, tmp_path, targets):
    path = save_peft(base[0], tmp_path / "rx", target_modules=targets, r=6,
                     rank_pattern={"q_proj": 2, "model.layers.0.self_attn.v_proj": 3, r"^model.layers.1.*v_proj": 5},
                     alpha_pattern={r".*\.v_proj": 16, r"(.*\.)?(q_proj|v_proj)": 8})
    ad = load_peft_adapter(path, base[1], 64)
    assert (ad.module(0, "q_proj").rank, ad.module(0, "v_proj").rank, ad.module(1, "v_proj").rank) == (2, 3, 5)
    cfg = parse_peft_config({"target_modules": r"model\.language_model.*\.(q_proj|k_proj)",
                             "layers_pattern": ["layers", "h"], "exclude_modules": r".*layers\.1\.mlp.*"})
    assert cfg.targets("model.language_model.layers.0.self_attn.k_proj")


def test_a_weight_name_with_a_control_character_is_refused(base, good_dir, tmp_path):
    """The config's regexes are budgeted for module paths, which hold no newline (a final `.*` cannot fail on them:
    adapters/peft/safe_regex.py): a weight name with one is a 400 before any regex runs on it."""
    path = clone(good_dir, tmp_path)
    state = load_file(path / "adapter_model.safetensors")
    state = {k.replace("model.model.layers.1.", "model.model\n.layers.1."): v for k, v in state.items()}
    save_file(state, str(path / "adapter_model.safetensors"))
    expect_error(path, base[1], code="unsupported_target_modules", match="control character")


def test_weights_under_two_stacks_of_layers_are_refused(base, good_dir, tmp_path):
    """Each stack of layers the weights name was checked against every module of the base (a targets() each, a
    config regex each): one stack per weight multiplied the work; one decoder's are served."""
    path = clone(good_dir, tmp_path)
    state = load_file(path / "adapter_model.safetensors")
    state = {k.replace("model.model.layers.1.", "model.other.layers.1."): v for k, v in state.items()}
    save_file(state, str(path / "adapter_model.safetensors"))
    expect_error(path, base[1], code="unsupported_target_modules", match="more than one stack of layers")


def test_dims_read_a_typed_checkpoint_fused_field():
    """A config object that says whether its checkpoint holds fused qkv_proj / gate_up_proj is believed over the
    Phi-3 model_type guess."""
    from types import SimpleNamespace

    fields = dict(hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=2,
                  vocab_size=64)
    assert BaseModelDims.from_model_config(SimpleNamespace(**fields, model_type="phi3")).checkpoint_fused
    assert BaseModelDims.from_model_config(SimpleNamespace(**fields, model_type="x", checkpoint_fused=True)).checkpoint_fused
    assert not BaseModelDims.from_model_config(SimpleNamespace(**fields, model_type="phi3",
                                                               checkpoint_fused=False)).checkpoint_fused
