"""Load a PEFT LoRA adapter (local dir or hub id) into host memory, validated against the base.

    adapter = load_peft_adapter("path/or/org-name", dims, max_lora_rank=64)

Errors are `AdapterError(message, code, status)`: 404 when the path / hub id is not found,
400 for everything else (bad config, unsupported feature, rank too large, wrong base,
corrupt weights). Files are opened through `adapters/peft/adapter_files.py`: by path for a folder the operator
named, beneath its `--lora-dir` without following links for a directory entry (`adapters/registry/folder_files.py`).
Messages name files, never the folder's path: tenants read them. The weights' keys they name are the file
author's text: shown through `adapters.errors.shown` (no '/', bounded).
"""

from __future__ import annotations

import json
import os
import pickle
import re
from typing import BinaryIO, Collection, Mapping, Optional, Union

import torch
from huggingface_hub import snapshot_download
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import load_file

from adapters.adapter import LoRAAdapter, LoRAModule
from adapters.peft.adapter_files import AdapterFiles, PathFiles
from adapters.layers.dims import CHECKPOINT_FUSED, BaseModelDims
from adapters.errors import (
    CODE_CORRUPT, CODE_INVALID, CODE_RANK_TOO_LARGE, CODE_SHAPE_MISMATCH,
    CODE_UNSUPPORTED_FEATURE, CODE_UNSUPPORTED_TARGET, AdapterError, AdapterNotFoundError, shown,
)
from adapters.peft.config import PeftLoRAConfig, parse_peft_config
from adapters.peft.expert_keys import SHARED_GATE, build_expert_modules, check_dense_mlp_targets, split_expert_state

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"

_KEY_RE = re.compile(
    r"^(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\."
    r"(?P<name>q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|qkv_proj|gate_up_proj))"
    r"\.(?:lora_(?P<ab>A|B)(?:\.[\w-]+)?\.weight|(?P<mag>lora_magnitude_vector)(?:\.[\w-]+)?(?:\.weight)?)$"
)
# LoRA on the vocabulary modules, as PEFT saves it: the embedding's A / B are parameters (no `.weight`), the LM
# head's a linear's; `base_layer.weight` is the base's own table, saved by PEFT beside them (save_embedding_layers)
_VOCAB_KEY_RE = re.compile(
    r"^(?P<module>(?:.*\.)?(?P<name>embed_tokens|lm_head))\."
    r"(?:lora_embedding_(?P<eab>A|B)(?:\.[\w-]+)?|lora_(?P<ab>A|B)(?:\.[\w-]+)?\.weight"
    r"|(?P<mag>lora_magnitude_vector)(?:\.[\w-]+)?(?:\.weight)?|(?P<base>base_layer\.weight))$"
)
# A multimodal base's vision tower (Gemma 3: `model.vision_tower.vision_model.encoder.layers.N.self_attn.q_proj`,
# targeted by a plain `q_proj`): the server takes text only, so its LoRA never reaches an output; skipped
_VISION_TOWER_RE = re.compile(r"(?:^|\.)vision_tower\.")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
           "qkv_proj": "self_attn", "gate_up_proj": "mlp"}
_HUB_ID_RE = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def _invalid(msg: str, code: str = CODE_INVALID) -> AdapterError:
    return AdapterError(msg, code=code, status=400)


def resolve_adapter_dir(source: Union[str, os.PathLike], revision: Optional[str] = None,
                        allow_download: bool = True) -> str:
    """Local directory of the adapter: the path itself, else a hub snapshot (cache first)."""
    text = os.fspath(source)
    path = os.path.expanduser(text)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise _invalid(f"adapter path {text!r} is not a directory")
    looks_local = os.path.isabs(path) or text.startswith((".", "~")) or not _HUB_ID_RE.match(text)
    if looks_local:
        raise AdapterNotFoundError(f"adapter path {text!r} not found")
    patterns = [CONFIG_NAME, SAFETENSORS_NAME, BIN_NAME, "added_tokens.json"]
    attempts = [True, False] if allow_download else [True]
    for local_only in attempts:
        try:
            return snapshot_download(text, revision=revision, allow_patterns=patterns,
                                     local_files_only=local_only)
        except Exception:  # noqa: BLE001 - any hub failure means "not found" for us
            continue
    raise AdapterNotFoundError(f"adapter {text!r} not found locally or on the hub")


MAX_KEY_CHARS = 256         # a weight's name: real ones are ~100 characters; config regexes run on them (safe_regex.py)
MAX_JSON_BYTES = 16 << 20   # adapter_config.json / added_tokens.json: real ones are a few KiB
_ABSENT = object()          # `_read_json`: no such file


def _describe(exc: BaseException) -> str:
    """A library error without the file's path (a tenant may read it): OSError's text names the file."""
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return str(exc) or type(exc).__name__


def _open(files: AdapterFiles, fname: str, code: str = CODE_INVALID) -> BinaryIO | None:
    try:
        return files.open(fname)
    except OSError as exc:   # permissions, I/O: the file's path stays out of the message
        raise _invalid(f"cannot read {fname}: {_describe(exc)}", code) from exc


def _read_json(files: AdapterFiles, fname: str) -> object:
    f = _open(files, fname)
    if f is None:
        return _ABSENT
    try:
        with f:
            data = f.read(MAX_JSON_BYTES + 1)
        if len(data) > MAX_JSON_BYTES:
            raise ValueError(f"larger than {MAX_JSON_BYTES} bytes")
        return json.loads(data.decode("utf-8"))
    except (OSError, ValueError) as exc:   # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _invalid(f"cannot read {fname}: {_describe(exc)}") from exc
    except RecursionError:                 # arrays or objects nested past the parser's recursion limit
        raise _invalid(f"cannot read {fname}: nested too deeply") from None


def _read_config(files: AdapterFiles) -> dict:
    raw = _read_json(files, CONFIG_NAME)
    if raw is _ABSENT:
        raise _invalid(f"not a PEFT adapter: {CONFIG_NAME} is missing")
    return raw  # type: ignore[return-value]  # parse_peft_config checks it is an object


def _check_added_tokens(files: AdapterFiles) -> None:
    try:
        added = _read_json(files, "added_tokens.json")
    except AdapterError as exc:
        if exc.status != 400:   # a --lora-dir file that left its folder: as absent as the adapter
            raise
        added = True            # unreadable: refused as if it added tokens
    if added is not _ABSENT and added:
        raise _invalid("adapters with added tokens (added_tokens.json) are not supported",
                       CODE_UNSUPPORTED_FEATURE)


def _load_safetensors(f: BinaryIO) -> dict[str, torch.Tensor]:
    """The tensors of an open safetensors file: memory-mapped through /proc/self/fd (the very file opened,
    whatever its path became since), else read whole."""
    proc = f"/proc/self/fd/{f.fileno()}"
    if os.path.exists(proc):
        return load_file(proc, device="cpu")
    return load_safetensors_bytes(f.read())


def _read_weights(files: AdapterFiles) -> dict[str, torch.Tensor]:
    f = _open(files, SAFETENSORS_NAME, CODE_CORRUPT)
    if f is not None:
        with f:
            try:
                return _load_safetensors(f)
            except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError, ...
                raise _invalid(f"cannot read {SAFETENSORS_NAME} (corrupt?): {_describe(exc)}", CODE_CORRUPT) from exc
    f = _open(files, BIN_NAME, CODE_CORRUPT)
    if f is None:
        raise _invalid(f"no {SAFETENSORS_NAME} or {BIN_NAME} in the adapter folder")
    with f:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)   # never unpickles anything else
        except pickle.UnpicklingError as exc:   # torch's text advises weights_only=False: not to a tenant
            raise _invalid(f"cannot read {BIN_NAME}: not a plain state dict of tensors (corrupt, or it pickles other "
                           f"objects, which are never loaded; save the adapter as {SAFETENSORS_NAME})",
                           CODE_CORRUPT) from exc
        except Exception as exc:  # noqa: BLE001
            raise _invalid(f"cannot read {BIN_NAME} (corrupt?): {_describe(exc)}", CODE_CORRUPT) from exc
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise _invalid(f"{BIN_NAME} is not a state dict of tensors", CODE_CORRUPT)
    return dict(state)


_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def _check_key_lengths(state: Mapping[str, torch.Tensor]) -> None:
    """The config's regexes run on the weights' names (linear to cubic time in their length, on names without a
    newline as module paths are: safe_regex.py)."""
    for key in state:
        if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
            raise _invalid(f"adapter weight name {shown(str(key))!r} is longer than {MAX_KEY_CHARS} characters",
                           CODE_UNSUPPORTED_TARGET)
        if _CONTROL_RE.search(key):
            raise _invalid(f"adapter weight name {shown(key)!r} holds a control character (no module path does)",
                           CODE_UNSUPPORTED_TARGET)


def _vision_tower_modules(state: Mapping[str, torch.Tensor]) -> set[str]:
    """The names (`fc1`, `q_proj`, ...) of the modules a multimodal base's vision tower has LoRA on (skipped)."""
    return {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in state if _VISION_TOWER_RE.search(k)}


def _check_finite(state: Mapping[str, torch.Tensor]) -> None:
    """NaN or infinite weights make every logit of the adapter's requests NaN (they stay in its own rows, but its
    tenant gets empty text): a 400 at load, naming the weight. One pass over tensors already in memory."""
    for key, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise _invalid(f"{shown(key)} has non-finite values (NaN or infinity)", CODE_CORRUPT)


def _reject_key(key: str, tensor: torch.Tensor, dims: BaseModelDims) -> AdapterError:
    if "embed_tokens" in key or "lm_head" in key:
        # Embedding / lm_head weights are [vocab, hidden]: another vocab size means resized.
        resized = tensor.dim() == 2 and int(tensor.shape[0]) != dims.vocab_size
        what = "resized embeddings / added tokens" if resized else "embedding or lm_head weights"
        return _invalid(f"adapter contains {what} ({shown(key)}); only LoRA (and DoRA) on q/k/v/o/gate/up/down, "
                        "LoRA on embed_tokens and LoRA (and DoRA) on lm_head are supported", CODE_UNSUPPORTED_FEATURE)
    if key.endswith(".bias"):
        return _invalid(f"adapter has a bias ({shown(key)}); only bias='none' is supported",
                        CODE_UNSUPPORTED_FEATURE)
    return _invalid(f"unsupported adapter weight {shown(key)!r}: only LoRA A/B (and DoRA magnitudes) on "
                    "q/k/v/o/gate/up/down_proj of decoder layers, embed_tokens and lm_head are supported",
                    CODE_UNSUPPORTED_TARGET)


def _module_key(module_path: str) -> str:
    """PEFT saves `base_model.model.<name in the base model>`; rank/alpha patterns match the latter."""
    prefix = "base_model.model."
    return module_path[len(prefix):] if module_path.startswith(prefix) else module_path


def _peft_module_key(module_path: str, entry_key: tuple[int, str], dims: BaseModelDims) -> str:
    """The module's name in the base model, as PEFT's rank / alpha patterns and target_modules match it: a dense
    MLP name on a sparse MoE layer of a base with a shared expert is Qwen2-MoE's shared expert (`split_expert_state`
    renamed its keys); elsewhere (Mixtral, Qwen3-MoE) it stays as saved (refused: `check_dense_mlp_targets`)."""
    key = _module_key(module_path)
    layer, name = entry_key
    if (layer >= 0 and _PARENT[name] == "mlp" and dims.shared_expert and layer < dims.num_layers
            and dims.is_sparse_layer(layer)):
        key = re.sub(r"\.mlp\.(\w+)$", r".mlp.shared_expert.\1", key)
    return key


def build_adapter_modules(state: Mapping[str, torch.Tensor], cfg: PeftLoRAConfig, dims: BaseModelDims,
                          max_lora_rank: int, elsewhere: Collection[tuple[int, str]] = ()
                          ) -> tuple[dict[tuple[int, str], LoRAModule], dict[str, LoRAModule]]:
    """(decoder layers' modules keyed (layer, HF name), vocabulary modules keyed "embed_tokens" / "lm_head")."""
    pairs: dict[tuple[int, str], dict[str, object]] = {}
    for key, tensor in state.items():
        if _VISION_TOWER_RE.search(key):
            continue
        m = _KEY_RE.match(key)
        if m is not None and m["parent"] == _PARENT[m["name"]]:
            part, entry_key = ("M" if m["mag"] else m["ab"]), (int(m["layer"]), m["name"])
        else:
            v = _VOCAB_KEY_RE.match(key)
            if v is None:
                raise _reject_key(key, tensor, dims)
            if v["base"]:
                _check_vocab_table(key, tensor, dims)    # PEFT's copy of the base table: the base's own
                continue
            part, entry_key = ("M" if v["mag"] else v["eab"] or v["ab"]), (-1, v["name"])
            m = v
        want_dim = 1 if part == "M" else 2
        if not tensor.is_floating_point() or tensor.dim() != want_dim:
            raise _invalid(f"{shown(key)} must be a {want_dim}-D floating point tensor", CODE_CORRUPT)
        entry = pairs.setdefault(entry_key, {"key": _peft_module_key(m["module"], entry_key, dims)})
        if part in entry:
            raise _invalid(f"duplicate LoRA {part} weight for {shown(str(entry['key']))}")
        entry[part] = tensor
    if not pairs:
        raise _invalid("adapter has no LoRA weights for q/k/v/o/gate/up/down_proj",
                       CODE_UNSUPPORTED_TARGET)
    modules: dict[tuple[int, str], LoRAModule] = {}
    vocab: dict[str, LoRAModule] = {}
    for (layer, name), entry in sorted(pairs.items()):
        module = _module_of(layer, name, entry, cfg, dims, max_lora_rank)
        if layer < 0:
            vocab[name] = module
            continue
        for part, part_module in _split_fused(name, module, dims):
            if (layer, part) in modules:
                raise _invalid(f"{shown(str(entry['key']))}: layer {layer} has LoRA on both {part} and a fused "
                               "module holding it")
            modules[(layer, part)] = part_module
    check_dense_mlp_targets(modules, dims)
    _check_config_targets(pairs, cfg, dims, elsewhere)
    if cfg.ties_lm_head:
        _check_tied_head(vocab)
    return modules, vocab


def _check_tied_head(vocab: Mapping[str, LoRAModule]) -> None:
    """ensure_weight_tying: PEFT's LM head LoRA is the embedding's, transposed (one storage: lm_head A = embed_tokens
    B^T, B = A^T), and PEFT saves both. A pair that disagrees has no single PEFT meaning (whichever loads last wins
    both): refused, as is an LM head tied to no embedding LoRA (exclude_modules naming the embedding)."""
    emb, head = vocab.get("embed_tokens"), vocab.get("lm_head")
    if emb is None or head is None:
        raise _invalid("ensure_weight_tying is set and the base ties its LM head to the embeddings: the adapter needs "
                       "LoRA on both embed_tokens and lm_head", CODE_UNSUPPORTED_TARGET)
    if not (head.lora_a.shape == emb.lora_b.t().shape and torch.equal(head.lora_a, emb.lora_b.t())
            and head.lora_b.shape == emb.lora_a.t().shape and torch.equal(head.lora_b, emb.lora_a.t())):
        raise _invalid("ensure_weight_tying is set and the base ties its LM head to the embeddings, but the adapter's "
                       "lm_head LoRA is not embed_tokens' transposed (PEFT ties the two)", CODE_SHAPE_MISMATCH)


_LAYER_PREFIX_RE = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.)\d+\.")


def _check_config_targets(pairs: Mapping[tuple[int, str], Mapping[str, object]], cfg: PeftLoRAConfig,
                          dims: BaseModelDims, elsewhere: Collection[tuple[int, str]] = ()) -> None:
    """The weights cover exactly the modules the config puts LoRA on, as PEFT decides it: PEFT ignores weights of
    a module it does not target, and gives a targeted module without weights its initial LoRA (random where
    `init_lora_weights` is false): serving either as saved would differ from PEFT. `elsewhere`: (layer, name) of
    modules the expert loader holds and checked for the first (Qwen2-MoE's shared-expert gate)."""
    for entry in pairs.values():
        mkey = str(entry["key"])
        if cfg.targets(mkey) is False:
            raise _invalid(f"adapter has LoRA weights for {shown(mkey)}, which adapter_config.json does not target "
                           "(target_modules / exclude_modules / layers_to_transform); PEFT would ignore them")
    layer_keys = [str(e["key"]) for (layer, _), e in pairs.items() if layer >= 0]
    prefixes = {m["prefix"] for m in map(_LAYER_PREFIX_RE.match, layer_keys) if m} or {"model.layers."}
    if len(prefixes) > 1:      # one decoder; and each prefix below costs a targets() per module of the base
        raise _invalid(f"adapter has LoRA weights under more than one stack of layers "
                       f"({shown(', '.join(sorted(prefixes)[:2]))}); one decoder's are supported", CODE_UNSUPPORTED_TARGET)
    fused = dims.checkpoint_fused or any(name in CHECKPOINT_FUSED for _, name in pairs)
    attn = ("qkv_proj", "o_proj") if fused else ("q_proj", "k_proj", "v_proj", "o_proj")
    mlp = ("gate_up_proj", "down_proj") if fused else ("gate_proj", "up_proj", "down_proj")
    expected: list[tuple[tuple[int, str], str]] = []
    for prefix in sorted(prefixes):
        for layer in range(dims.num_layers):
            names = [("self_attn", n) for n in attn]
            if not dims.is_sparse_layer(layer):      # a sparse MoE layer's MLP is its experts (expert_keys.py)
                names += [("mlp", n) for n in mlp]
            elif dims.shared_expert:                 # ... and Qwen2-MoE's shared expert (its keys renamed: (layer, n))
                names += [("mlp.shared_expert", n) for n in mlp] + [("mlp", SHARED_GATE)]   # and its gate
            expected += [((layer, n), f"{prefix}{layer}.{parent}.{n}") for parent, n in names]
        outer = prefix[:-len("layers.")]             # `model.layers.` -> `model.embed_tokens`
        expected += [((-1, "embed_tokens"), f"{outer}embed_tokens"), ((-1, "lm_head"), "lm_head")]
    for entry_key, mkey in expected:
        if entry_key not in pairs and entry_key not in elsewhere and cfg.targets(mkey):
            raise _invalid(f"adapter_config.json targets {shown(mkey)} but the adapter has no LoRA weights for it "
                           "(truncated adapter, or one for another model?)", CODE_SHAPE_MISMATCH)


def _check_vocab_table(key: str, tensor: torch.Tensor, dims: BaseModelDims) -> None:
    if tensor.dim() != 2 or tuple(tensor.shape) != (dims.vocab_size, dims.hidden_size):
        raise _invalid(f"adapter contains resized embeddings / added tokens ({shown(key)}); only the base's vocabulary "
                       "is supported", CODE_UNSUPPORTED_FEATURE)


def _vocab_shapes(name: str, rank: int, dims: BaseModelDims) -> tuple[tuple[int, int], tuple[int, int]]:
    """Expected (A, B) shapes of a vocabulary module: the embedding's A is [r, vocab] (PEFT's layout)."""
    if name == "embed_tokens":
        return (rank, dims.vocab_size), (dims.hidden_size, rank)
    return (rank, dims.hidden_size), (dims.vocab_size, rank)


def _module_of(layer: int, name: str, entry: dict[str, object], cfg: PeftLoRAConfig, dims: BaseModelDims,
               max_lora_rank: int) -> LoRAModule:
    mkey = str(entry["key"])          # the config's rank / alpha patterns match it
    label = shown(mkey)               # what the messages show of it
    if "A" not in entry or "B" not in entry:
        raise _invalid(f"{label} has lora_A without lora_B or the reverse")
    a, b, mag = entry["A"], entry["B"], entry.get("M")
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if layer >= dims.num_layers:
        raise _invalid(f"{label}: layer {layer} does not exist in the base model "
                       f"({dims.num_layers} layers); wrong base model?", CODE_SHAPE_MISMATCH)
    rank = int(a.shape[0])
    if b.dim() == 2 and int(b.shape[1]) != rank:   # A [r, in], B [out, r] in every layout (the embedding's too)
        raise _invalid(f"{label}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit each other: "
                       f"lora_A has rank {rank}, lora_B rank {int(b.shape[1])} (malformed adapter weights)",
                       CODE_SHAPE_MISMATCH)
    if rank > max_lora_rank:
        raise _invalid(f"{label} has rank {rank} > max_lora_rank {max_lora_rank}", CODE_RANK_TOO_LARGE)
    if layer < 0:
        want_a, want_b = _vocab_shapes(name, rank, dims)
    else:
        in_f, out_f = dims.module_shape(name)
        want_a, want_b = (rank, in_f), (out_f, rank)
    if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
        raise _invalid(
            f"{label}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base model (expected "
            f"{list(want_a)} / {list(want_b)}); adapter for a different base model?", CODE_SHAPE_MISMATCH)
    if cfg.rank_for(mkey) != rank:
        raise _invalid(f"{label}: weights have rank {rank} but the config says "
                       f"{cfg.rank_for(mkey)}", CODE_SHAPE_MISMATCH)
    if mag is not None:
        assert isinstance(mag, torch.Tensor)
        if name == "embed_tokens":
            raise _invalid("DoRA on the embeddings (embed_tokens) is not supported", CODE_UNSUPPORTED_FEATURE)
        if not cfg.use_dora:
            raise _invalid(f"{label} has a DoRA magnitude vector but the config has no use_dora")
        if tuple(mag.shape) != (want_b[0],):
            raise _invalid(f"{label}: lora_magnitude_vector {tuple(mag.shape)} does not fit the base model "
                           f"(expected [{want_b[0]}])", CODE_SHAPE_MISMATCH)
        mag = mag.float().contiguous()
        if not bool(torch.isfinite(mag).all()):
            raise _invalid(f"{label}: lora_magnitude_vector has non-finite values", CODE_CORRUPT)
    elif cfg.use_dora and name != "embed_tokens":
        raise _invalid(f"{label}: use_dora is set but the module has no lora_magnitude_vector", CODE_CORRUPT)
    return LoRAModule(lora_a=a.contiguous(), lora_b=b.contiguous(), scaling=cfg.scaling_for(mkey, rank),
                      magnitude=mag)


def _split_fused(name: str, module: LoRAModule, dims: BaseModelDims) -> list[tuple[str, LoRAModule]]:
    """A checkpoint-fused module (Phi-3 qkv_proj / gate_up_proj) as its slices: B's rows per slice, A shared
    (B_slice @ A is exactly the slice of the fused delta)."""
    if name not in CHECKPOINT_FUSED:
        return [(name, module)]
    parts, start = [], 0
    for part in CHECKPOINT_FUSED[name]:
        size = dims.module_shape(part)[1]
        mag = None if module.magnitude is None else module.magnitude[start:start + size].contiguous()
        parts.append((part, LoRAModule(module.lora_a, module.lora_b[start:start + size].contiguous(),
                                       module.scaling, mag)))
        start += size
    return parts


def load_peft_adapter(
    source: Union[str, os.PathLike, AdapterFiles],
    dims: BaseModelDims,
    max_lora_rank: int,
    *,
    revision: Optional[str] = None,
    allow_download: bool = True,
) -> LoRAAdapter:
    """Read and validate a PEFT LoRA adapter; the tensors stay on the CPU in their saved dtype. `source` is a
    path or hub id, or an `AdapterFiles` (a `--lora-dir` entry opened without following links). Error
    messages name files, never the folder's path (only `resolve_adapter_dir` echoes the path it was given)."""
    if isinstance(source, AdapterFiles):
        files = source
    else:
        files = PathFiles(resolve_adapter_dir(source, revision, allow_download), label=os.fspath(source))
    raw = _read_config(files)
    cfg = parse_peft_config(raw).on_base(dims.tie_word_embeddings)
    _check_added_tokens(files)
    weights = _read_weights(files)
    _check_key_lengths(weights)
    cfg.check_unsupported_targets(_vision_tower_modules(weights))
    _check_finite(weights)
    state, expert_state = split_expert_state(weights)   # MoE experts: adapters/peft/expert_keys.py
    experts = build_expert_modules(expert_state, cfg, raw, dims, max_lora_rank)
    elsewhere = {(layer, proj) for layer, _, proj in experts if proj == SHARED_GATE}   # a module, checked as one
    if state or not experts:
        modules, vocab = build_adapter_modules(state, cfg, dims, max_lora_rank, elsewhere)
    else:                       # experts' weights only: still none missing of the modules the config targets
        modules, vocab = {}, {}
        _check_config_targets({}, cfg, dims, elsewhere)
    return LoRAAdapter(
        source=files.label, path=files.path, modules=modules,
        base_model_name_or_path=cfg.base_model_name_or_path, config=raw, expert_modules=experts,
        vocab_modules=vocab,
    )
