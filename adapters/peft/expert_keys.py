"""LoRA on the experts of an MoE base, in the two layouts PEFT saves it, as per-expert factors.

1. `target_parameters` on the fused 3-D expert tensors (peft's `ParamWrapper`, transformers 5 models):
   `layers.N.mlp.experts[.base_layer]*.lora_A.weight` [r*E, in] and `lora_B.weight` [out, r*E]. Wrappers nest
   (one `.base_layer` deeper each) in the order peft meets the parameters in the module, not the config's, so
   the pair's shapes say which tensor it adapts: A [r*E, H] with B [2I, r*E] (gate_up_proj) or A [r*E, I]
   with B [H, r*E] (down_proj); both at once would need H == I == 2I. For parameter W [E, out, in]
   (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) PEFT's delta is
   einsum("o r e, e r i -> e o i", B.reshape(out, r, E), A.reshape(E, r, in)) * scaling: expert e's
   A_e = A[e*r:(e+1)*r] (expert-major rows) and B_e = B[:, e::E] (rank-major columns), W_e + s * B_e @ A_e.
   `gate_up_proj`'s B_e rows split into the gate half and the up half (one shared A_e).
2. per-expert LoRA modules (hub adapters trained on transformers 4 models): `layers.N.block_sparse_moe.experts.
   M.w1 / w3 / w2` (Mixtral) or `layers.N.mlp.experts.M.gate_proj / up_proj / down_proj` (Qwen).

3. the router (`mlp.gate`, Mixtral's `block_sparse_moe.gate`): `target_parameters` on `mlp.gate.weight`, or
   `gate` in `target_modules` of a transformers-4 adapter: `mlp.gate.lora_A.weight` [r, H], `lora_B.weight`
   [E, r], a LoRA like any linear's on the router logits; kept as expert -1, projection "gate".

4. Qwen2-MoE's shared-expert gate (`mlp.shared_expert_gate`, hidden -> 1, in `target_modules`: peft expands
   "all-linear" into it): `mlp.shared_expert_gate.lora_A.weight` [r, H], `lora_B.weight` [1, r]; kept as expert -1,
   projection "shared_expert_gate", its name matched against target_modules / rank_pattern / alpha_pattern as
   PEFT does. `target_parameters` on `mlp.shared_expert_gate.weight` stays refused (400).

Qwen2-MoE's shared expert (`mlp.shared_expert.gate_proj`, ...) is a dense MLP: its keys are renamed to the
dense names (`mlp.gate_proj`, ...) for the dense loader.

DoRA (`use_dora`) on the router or the shared-expert gate as a module (`target_modules`: peft's all-linear DoRA
adapter on Qwen2-MoE puts it on the gate): `....lora_magnitude_vector` [out] beside the pair, kept as the module's
magnitude; the slots compute m / ||W + s B A||_row from the base weight (adapters/slots/expert_slots.py). peft's
`target_parameters` (the router's weight, the fused experts) takes no DoRA: a DoRA adapter with them is refused.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from adapters.adapter import LoRAModule
from adapters.errors import CODE_CORRUPT, CODE_INVALID, CODE_RANK_TOO_LARGE, CODE_SHAPE_MISMATCH, \
    CODE_UNSUPPORTED_FEATURE, CODE_UNSUPPORTED_TARGET, shown, AdapterError
from adapters.layers.dims import BaseModelDims
from adapters.peft.config import PeftLoRAConfig

# (layer, expert, "gate_proj" | "up_proj" | "down_proj"); the router's: (layer, ROUTER, "gate"); the shared-expert
# gate's: (layer, ROUTER, SHARED_GATE)
ExpertKey = tuple[int, int, str]
ROUTER = -1                         # the expert index of the router's and the shared-expert gate's LoRA
SHARED_GATE = "shared_expert_gate"

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")  # the fused expert tensors `target_parameters` may name

_PER_EXPERT = re.compile(r"^(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts\."
                         r"(?P<expert>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj))"
                         r"\.lora_(?P<ab>A|B)(?:\.[\w-]+)?\.weight$")
_PARAM_WRAPPER = re.compile(r"^(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.mlp\.experts)(?P<depth>(?:\.base_layer)*)"
                            r"\.lora_(?P<ab>A|B)(?:\.[\w-]+)?\.weight$")
_ROUTER_KEY = re.compile(r"^(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.gate)"
                         r"\.lora_(?P<ab>A|B)(?:\.[\w-]+)?\.weight$")
_SHARED_GATE_KEY = re.compile(r"^(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.mlp\.shared_expert_gate)"
                              r"\.lora_(?P<ab>A|B)(?:\.[\w-]+)?\.weight$")
# DoRA's magnitude on the router or the shared-expert gate
_LAYER_LINEAR_DORA = re.compile(r"^(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\."
                                r"(?P<proj>gate|shared_expert_gate))\.lora_magnitude_vector(?:\.[\w-]+)?(?:\.weight)?$")
# DoRA's magnitude on an expert (transformers-4 per-expert modules): not served (a clear 400)
_EXPERT_DORA = re.compile(r"^(?:.*\.)?layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.\d+\.\w+"
                          r"\.lora_magnitude_vector(?:\.[\w-]+)?(?:\.weight)?$")
_SHARED = re.compile(r"(layers\.\d+\.mlp)\.shared_expert\.(gate_proj|up_proj|down_proj)\.")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
         "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


def _invalid(msg: str, code: str) -> AdapterError:
    return AdapterError(msg, code=code, status=400)


def _module_key(module_path: str) -> str:
    prefix = "base_model.model."
    return module_path[len(prefix):] if module_path.startswith(prefix) else module_path


def expert_parameter_order(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """`target_parameters` as expert tensor names (a parameter's path or a dotted suffix of it, as PEFT matches
    them: `mlp.experts.gate_up_proj`, `experts.down_proj`, `gate_up_proj`); 400 for anything else."""
    targets = raw.get("target_parameters") or []
    if isinstance(targets, str) or not isinstance(targets, (list, tuple)):
        raise _invalid("target_parameters must be a list", CODE_UNSUPPORTED_TARGET)
    names = []
    for t in targets:
        if str(t) == "gate.weight" or str(t).endswith((".mlp.gate.weight", "mlp.gate.weight")):
            names.append("gate")                      # the router's weight
            continue
        name = str(t).rsplit(".", 1)[-1]   # `mlp.experts.gate_up_proj`, `experts.gate_up_proj` or bare, as peft
        if name not in EXPERT_PARAMETERS:   # 0.21 saves it for transformers 5 models (it matches dotted suffixes)
            raise _invalid(f"unsupported target parameter {str(t)!r}; supported: LoRA on the MoE experts' "
                           f"{' / '.join('mlp.experts.' + p for p in EXPERT_PARAMETERS)} (or a dotted suffix: "
                           f"{' / '.join(EXPERT_PARAMETERS)}) and the router's "
                           "mlp.gate.weight", CODE_UNSUPPORTED_TARGET)
        names.append(name)
    return tuple(names)


def split_expert_state(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the dense keys, the shared expert's renamed to the dense names; the experts' keys)."""
    dense, experts = {}, {}
    for key, tensor in state.items():
        if _EXPERT_DORA.match(key):
            raise _expert_dora_refused(key)
        if _PER_EXPERT.match(key) or _PARAM_WRAPPER.match(key) or _ROUTER_KEY.match(key) or \
                _SHARED_GATE_KEY.match(key) or _LAYER_LINEAR_DORA.match(key):
            experts[key] = tensor
        else:
            dense[_SHARED.sub(r"\1.\2.", key)] = tensor
    return dense, experts


def _expert_dora_refused(key: str) -> AdapterError:
    return _invalid(f"{shown(key)}: DoRA (use_dora) on the MoE experts is not supported; leave the experts out of the "
                    "DoRA adapter (exclude_modules) or train it without use_dora", CODE_UNSUPPORTED_FEATURE)


def _dora_refused(key: str) -> AdapterError:
    return _invalid(f"{shown(key)}: DoRA (use_dora) through target_parameters (the MoE router's weight or the fused "
                    "experts) is not supported (peft has no DoRA there either); target the modules, or train it "
                    "without use_dora", CODE_UNSUPPORTED_FEATURE)


def _pairs(state: Mapping[str, torch.Tensor], dims: BaseModelDims) -> dict[tuple[int, str, int | None], dict[str, Any]]:
    """(layer, per-expert projection or a ParamWrapper's depth, expert or None) -> {"key", "A", "B"}."""
    pairs: dict[tuple[int, str, int | None], dict[str, Any]] = {}
    for key, tensor in state.items():
        mag = _LAYER_LINEAR_DORA.match(key)
        if not tensor.is_floating_point() or tensor.dim() != (1 if mag is not None else 2):
            raise _invalid(f"{shown(key)} must be a {1 if mag is not None else 2}-D floating point tensor",
                           CODE_CORRUPT)
        if mag is not None:
            proj = "gate" if mag["proj"] == "gate" else SHARED_GATE
            entry = pairs.setdefault((int(mag["layer"]), proj, ROUTER), {"key": _module_key(mag["module"])})
            if "M" in entry:
                raise _invalid(f"duplicate DoRA magnitude for {shown(entry['key'])}", CODE_CORRUPT)
            entry["M"] = tensor
            continue
        m = _PER_EXPERT.match(key)
        router, shared_gate = _ROUTER_KEY.match(key), _SHARED_GATE_KEY.match(key)
        if m is not None:
            pkey: tuple[int, str, int | None] = (int(m["layer"]), _PROJ[m["proj"]], int(m["expert"]))
        elif router is not None:
            m, pkey = router, (int(router["layer"]), "gate", ROUTER)
        elif shared_gate is not None:
            m, pkey = shared_gate, (int(shared_gate["layer"]), SHARED_GATE, ROUTER)
        else:
            m = _PARAM_WRAPPER.match(key)
            assert m is not None
            pkey = (int(m["layer"]), m["depth"], None)       # the wrapper; which tensor: its shapes (below)
        entry = pairs.setdefault(pkey, {"key": _module_key(m["module"])})
        if m["ab"] in entry:
            raise _invalid(f"duplicate LoRA {m['ab']} weight for {shown(entry['key'])}", CODE_CORRUPT)
        entry[m["ab"]] = tensor
        if pkey[0] >= dims.num_layers or not dims.is_sparse_layer(pkey[0]):
            raise _invalid(f"{shown(entry['key'])}: the base model has no such MoE layer; wrong base model?",
                           CODE_SHAPE_MISMATCH)
        if pkey[1] == SHARED_GATE and not dims.shared_expert:
            raise _invalid(f"{shown(entry['key'])}: the base model's MoE layers have no shared-expert gate; wrong base "
                           "model?", CODE_SHAPE_MISMATCH)
        if pkey[2] is not None and not ROUTER <= pkey[2] < dims.num_experts:
            raise _invalid(f"{shown(entry['key'])}: expert {pkey[2]} does not exist (the base has {dims.num_experts})",
                           CODE_SHAPE_MISMATCH)
    return pairs


def build_expert_modules(state: Mapping[str, torch.Tensor], cfg: PeftLoRAConfig, raw: Mapping[str, Any],
                         dims: BaseModelDims, max_lora_rank: int) -> dict[ExpertKey, LoRAModule]:
    """Per-expert LoRA factors of every expert key in `state` (validated against the base's dims)."""
    order = expert_parameter_order(raw)          # checked whether or not the weights use it
    h, inter, num_experts = dims.hidden_size, dims.moe_intermediate_size, dims.num_experts
    in_out = {"gate_up_proj": (h, 2 * inter), "down_proj": (inter, h), "gate_proj": (h, inter),
              "up_proj": (h, inter), "gate": (h, num_experts), SHARED_GATE: (h, 1)}
    out: dict[ExpertKey, LoRAModule] = {}
    for (layer, proj, expert), entry in sorted(_pairs(state, dims).items(), key=lambda kv: str(kv[0])):
        mkey = entry["key"]
        if "A" not in entry and "B" not in entry:
            raise _invalid(f"{shown(mkey)} has a DoRA magnitude vector but no LoRA A / B", CODE_CORRUPT)
        if "A" not in entry or "B" not in entry:
            raise _invalid(f"{shown(mkey)} has lora_A without lora_B or the reverse", CODE_CORRUPT)
        a, b = entry["A"], entry["B"]
        if expert is None:                                            # a ParamWrapper: gate_up_proj or down_proj?
            proj = "gate_up_proj" if int(b.shape[0]) == 2 * inter else "down_proj"
            if proj not in order:
                raise _invalid(f"{shown(mkey)}: LoRA on experts.{proj}, which target_parameters does not name",
                               CODE_UNSUPPORTED_TARGET)
        # the name PEFT matches rank / alpha patterns against: a parameter's path (`mlp.experts.gate_up_proj`, the
        # router's `mlp.gate.weight` under target_parameters), else the module's
        if expert is None:
            mkey = f"{mkey}.{proj}"
        elif proj == "gate" and "gate" in order:
            mkey = f"{mkey}.weight"
        magnitude = entry.get("M")
        if cfg.use_dora and (expert is None or mkey.endswith(".weight")):   # target_parameters: no DoRA in peft
            raise _dora_refused(mkey)
        if cfg.use_dora and expert != ROUTER:   # per-expert modules: peft puts DoRA on them (magnitudes or not)
            raise _expert_dora_refused(mkey)
        if proj == SHARED_GATE and cfg.targets(mkey) is False:   # a module, named in target_modules as PEFT matches
            raise _invalid(f"adapter has LoRA weights for {shown(mkey)}, which adapter_config.json does not target "
                           "(target_modules / exclude_modules / layers_to_transform); PEFT would ignore them",
                           CODE_INVALID)
        in_f, out_f = in_out[proj]
        num = 1 if expert is not None else num_experts
        rank = int(a.shape[0]) // num
        if rank == 0 or tuple(a.shape) != (rank * num, in_f) or tuple(b.shape) != (out_f, rank * num):
            raise _invalid(f"{shown(mkey)}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
                           f"model's experts (expected [{num} r, {in_f}] / [{out_f}, {num} r]); adapter for a "
                           "different base model?", CODE_SHAPE_MISMATCH)
        if rank > max_lora_rank:
            raise _invalid(f"{shown(mkey)} has rank {rank} > max_lora_rank {max_lora_rank}", CODE_RANK_TOO_LARGE)
        if cfg.rank_for(mkey) != rank:
            raise _invalid(f"{shown(mkey)}: weights have rank {rank} but the config says {cfg.rank_for(mkey)}",
                           CODE_SHAPE_MISMATCH)
        scaling = cfg.scaling_for(mkey, rank)
        if expert == ROUTER:
            _check_magnitude(mkey, magnitude, cfg.use_dora, out_f)
        if expert is not None:
            _put(out, (layer, expert, proj), LoRAModule(a.contiguous(), b.contiguous(), scaling,
                                                        magnitude=None if magnitude is None else
                                                        magnitude.float().contiguous()), mkey)
            continue
        for e in range(num_experts):
            a_e = a[e * rank:(e + 1) * rank].contiguous()             # [r, in]: expert-major rows
            b_e = b[:, e::num_experts]                                # [out, r]: rank-major columns
            if proj == "down_proj":
                _put(out, (layer, e, proj), LoRAModule(a_e, b_e.contiguous(), scaling), mkey)
            else:                                                     # gate rows, then up rows
                _put(out, (layer, e, "gate_proj"), LoRAModule(a_e, b_e[:inter].contiguous(), scaling), mkey)
                _put(out, (layer, e, "up_proj"), LoRAModule(a_e, b_e[inter:].contiguous(), scaling), mkey)
    return out


def _check_magnitude(mkey: str, magnitude: torch.Tensor | None, use_dora: bool, out_f: int) -> None:
    """The router's or shared-expert gate's DoRA magnitude: present exactly under use_dora, [out], finite."""
    if magnitude is None:
        if use_dora:
            raise _invalid(f"{shown(mkey)}: use_dora is set but the module has no lora_magnitude_vector",
                           CODE_CORRUPT)
        return
    if not use_dora:
        raise _invalid(f"{shown(mkey)} has a DoRA magnitude vector but the config has no use_dora", CODE_INVALID)
    if tuple(magnitude.shape) != (out_f,):
        raise _invalid(f"{shown(mkey)}: lora_magnitude_vector {tuple(magnitude.shape)} does not fit the base model "
                       f"(expected ({out_f},))", CODE_SHAPE_MISMATCH)
    if not bool(torch.isfinite(magnitude).all()):
        raise _invalid(f"{shown(mkey)}: lora_magnitude_vector has non-finite values", CODE_CORRUPT)


def _put(out: dict[ExpertKey, LoRAModule], key: ExpertKey, module: LoRAModule, mkey: str) -> None:
    if key in out:
        raise _invalid(f"{shown(mkey)}: layer {key[0]} expert {key[1]} has LoRA on {key[2]} twice (per expert and on "
                       "the fused tensor)", CODE_UNSUPPORTED_TARGET)
    out[key] = module


def check_dense_mlp_targets(modules: Mapping[tuple[int, str], LoRAModule], dims: BaseModelDims) -> None:
    """LoRA on gate/up/down under the dense names only where the layer has a dense MLP (a dense layer, or
    Qwen2-MoE's shared expert): on a layer of experts alone it would be served as nothing (400)."""
    for layer, name in modules:
        if name in ("gate_proj", "up_proj", "down_proj") and layer < dims.num_layers and not dims.has_dense_mlp(layer):
            raise _invalid(f"LoRA on {name} of layer {layer}, which has no dense MLP (only experts: target them "
                           "per expert or through target_parameters)", CODE_UNSUPPORTED_TARGET)
