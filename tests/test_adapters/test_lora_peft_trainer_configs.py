"""Adapter configs as trainers write them, beyond what `LoraConfig` defaults give: Unsloth's target regexes,
`all-linear` on a multimodal checkpoint, `ensure_weight_tying` on a tied base, MiCA initialisation. Each was refused
with a 400 although PEFT serves it; each is served as `PeftModel` computes it (greedy fp32 token for token), or
refused where PEFT has no single meaning for it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning",
                                        "ignore:.*save_embedding_layers.*:UserWarning")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from adapters.errors import AdapterError  # noqa: E402
from adapters.layers.dims import BaseModelDims  # noqa: E402
from adapters.peft.loader import load_peft_adapter  # noqa: E402
from core.config import ModelConfig  # noqa: E402
from lora_fixtures import _fill_lora, _fresh_base, _save_adapter  # noqa: E402
from lora_tree import check_served_as_peft  # noqa: E402
from testlib import PROMPTS, model_dir  # noqa: E402

MAX_TOKENS = 6
TEXTS = [PROMPTS[2], PROMPTS[7]]


def dims_of(path: Path) -> BaseModelDims:
    return BaseModelDims.from_model_config(ModelConfig.from_path(path))


def save(path: Path, out: Path, **kwargs) -> Path:
    """Random non-zero LoRA of rank 4 saved by peft (`_save_adapter`: init_lora_weights=False, then filled)."""
    return _save_adapter(_fresh_base(str(path)), {"r": 4, "lora_alpha": 8, **kwargs}, 1.5, 5, out)


def expect_400(path: Path, dims: BaseModelDims, code: str, match: str) -> AdapterError:
    with pytest.raises(AdapterError, match=match) as err:
        load_peft_adapter(path, dims, max_lora_rank=16)
    assert (err.value.status, err.value.code) == (400, code)
    return err.value


def copy_with(src: Path, out: Path, config: dict | None = None, edit=None) -> Path:
    """A copy of an adapter folder with `config` merged into its adapter_config.json and `edit` run on its weights."""
    shutil.copytree(src, out)
    if config:
        cfg = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    if edit:
        state = load_file(str(out / "adapter_model.safetensors"))
        edit(state)
        save_file(state, str(out / "adapter_model.safetensors"))
    return out


def _peft_saved(path: Path, out: Path, fill, **kwargs) -> Path:
    """An adapter made and saved by `peft` itself with `kwargs` as they are (`init_lora_weights` included)."""
    import peft

    pm = peft.get_peft_model(_fresh_base(str(path)), peft.LoraConfig(task_type="CAUSAL_LM", **kwargs)).eval()
    fill(pm)
    pm.save_pretrained(str(out))
    return out


def test_ensure_weight_tying_on_a_tied_base_is_served_as_peft(tmp_path: Path) -> None:
    """peft's `ensure_weight_tying` on a base with tied embeddings (Qwen2 small, Gemma, Llama 3.2 1B): the LM head
    gets the embedding's LoRA transposed, saved under `lm_head.lora_A/B` while target_modules no longer name lm_head.
    Such adapters were refused ("adapter has LoRA weights for lm_head, which adapter_config.json does not target;
    PEFT would ignore them": PEFT does not); served as PEFT, and a tampered pair is a 400."""
    path = model_dir("qwen2_tied")
    dims = dims_of(path)
    tied = _peft_saved(path, tmp_path / "tied", lambda pm: _fill_lora(pm, 1.0, 5), r=4, lora_alpha=8,
                       init_lora_weights=False, target_modules=["embed_tokens", "q_proj"], ensure_weight_tying=True)
    assert "lm_head" not in json.loads((tied / "adapter_config.json").read_text())["target_modules"]
    ad = load_peft_adapter(tied, dims, max_lora_rank=16)
    assert torch.equal(ad.vocab_modules["lm_head"].lora_a, ad.vocab_modules["embed_tokens"].lora_b.t())
    check_served_as_peft(path, {"tied": tied}, TEXTS, MAX_TOKENS)
    key = "base_model.model.lm_head.lora_A.weight"
    untied = copy_with(tied, tmp_path / "untied", edit=lambda s: s.update({key: s[key] * 2}))
    err = expect_400(untied, dims, "adapter_shape_mismatch", "ensure_weight_tying")
    assert "transposed" in str(err)


def test_mica_adapters_are_served_as_peft(tmp_path: Path) -> None:
    """MiCA (`init_lora_weights="mica"`) only initialises B from the base's minor singular vectors, and peft saves
    that B: the forward is plain LoRA's. Such adapters were refused as needing "a modified base model"; served as
    PEFT. With use_dora (no such PEFT variant) a 400."""
    path = model_dir("llama_gqa")

    def fill_a(pm) -> None:
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in sorted(pm.named_parameters()):
                if "lora_A" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 3 / p.shape[1] ** 0.5)

    mica = _peft_saved(path, tmp_path / "mica", fill_a, r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                       init_lora_weights="mica")
    check_served_as_peft(path, {"mica": mica}, TEXTS, MAX_TOKENS)
    dora = copy_with(mica, tmp_path / "mica-dora", {"use_dora": True})
    expect_400(dora, dims_of(path), "unsupported_adapter_feature", "mica")


def test_all_linear_on_a_multimodal_checkpoint_is_served_as_peft(tmp_path: Path) -> None:
    """peft saves `all-linear` on Gemma 3's multimodal checkpoint as the names of every linear, the vision tower's
    fc1 / fc2 / out_proj among them: refused as "unsupported target modules [fc1, fc2, out_proj]", although the
    tower's LoRA never reaches a text output (and is skipped). A name outside the supported set is accepted when the
    adapter has it on the vision tower only; elsewhere it is still a 400 naming it."""
    from family_models import gemma3_multimodal_dir

    path = gemma3_multimodal_dir()
    adapter = save(path, tmp_path / "all-linear", target_modules="all-linear")
    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert {"fc1", "fc2", "out_proj"} <= set(targets)
    check_served_as_peft(path, {"all-linear": adapter}, TEXTS, MAX_TOKENS)
    no_tower = copy_with(adapter, tmp_path / "no-tower",
                         edit=lambda s: [s.pop(k) for k in [k for k in s if ".fc2." in k]])
    expect_400(no_tower, dims_of(path), "unsupported_target_modules", r"unsupported target modules \[fc2\]")


# target_modules as Unsloth writes them (unsloth_zoo's get_peft_regex, FastModel / FastVisionModel): an older form
# with a final `.*?`, and the current one with a lookahead; each came in a real adapter_config.json
UNSLOTH_OLD = (r"(?:.*?(?:language|text).*?(?:self_attn|attention|attn|mlp|feed_forward|ffn|dense).*?(?:q_proj|k_proj|"
               r"v_proj|o_proj|gate_proj|up_proj|down_proj).*?)|(?:\bmodel\.layers\.[\d]{1,}\.(?:self_attn|attention|"
               r"attn|mlp|feed_forward|ffn|dense)\.(?:(?:q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)))")
UNSLOTH_NEW = (r"(?:.*?(?:language|text).*?(?:self_attn|attention|attn|mixer|mlp|feed_forward|ffn|dense|mixer).*?\."
               r"(?:q_proj|v_proj|o_proj))|(?:\bmodel\.layers\.[\d]{1,}(?!.*\.experts\.\d)\..*?(?:self_attn|attention|"
               r"attn|mixer|mlp|feed_forward|ffn|dense|mixer).*?\.(?:(?:q_proj|v_proj|o_proj)))")


def test_unsloth_target_regexes_are_served_as_peft(tmp_path: Path) -> None:
    """Unsloth saves target_modules as one regex of alternatives with four or five unbounded repeats in all: the
    regex check counted them summed over the alternatives, lookahead and final `.*?` included, and refused every
    such adapter ("more than 3 unbounded repeats"). Counted as the matcher backtracks (safe_regex.py) they are three
    in a row at most; served as PEFT (Llama: the `model.layers` alternative; Gemma 3's multimodal checkpoint: the
    `language_model` one)."""
    from family_models import gemma3_multimodal_dir

    path = model_dir("llama_gqa")
    new = save(path, tmp_path / "unsloth-new", target_modules=UNSLOTH_NEW)
    check_served_as_peft(path, {"unsloth-new": new}, TEXTS, MAX_TOKENS)
    gemma = gemma3_multimodal_dir()
    old = save(gemma, tmp_path / "unsloth-old", target_modules=UNSLOTH_OLD)
    check_served_as_peft(gemma, {"unsloth-old": old}, TEXTS, MAX_TOKENS)
