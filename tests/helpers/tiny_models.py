"""Tiny, fully offline HF-format Llama-family checkpoints for tests and benchmarks.

The tokenizer is a byte-level BPE trained on Python standard library sources; the
model weights are random but initialised so greedy decoding has a clear top-1 vs
top-2 logit margin at nearly every step (so two correct engines agree on argmax).
`transformers` is used only to create and save the random checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from scratch_dirs import scratch_dir

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_MARKERS: tuple[str, ...] = ("<|user|>", "<|assistant|>", "<|system|>", "<|end|>")
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS) + CHAT_MARKERS
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

_TOKENIZER_CACHE: dict[tuple[int, int, int], Path] = {}
_MODEL_CACHE: dict[tuple[Any, ...], Path] = {}
_CACHE_ROOT: Path | None = None


def _cache_root() -> Path:
    global _CACHE_ROOT
    if _CACHE_ROOT is None:
        _CACHE_ROOT = scratch_dir("loraplex_tiny_")
    return _CACHE_ROOT


def stdlib_text_files(limit: int) -> list[Path]:
    """Deterministic list of up to `limit` stdlib `.py` files (sorted, no tests/site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__",
            "encodings", "pydoc_data"}
    out: list[Path] = []
    for path in sorted(root.rglob("*.py")):
        if skip.intersection(path.relative_to(root).parts):
            continue
        out.append(path)
        if len(out) >= limit:
            break
    return out


def iter_stdlib_text(num_files: int, max_chars_per_file: int = 20_000) -> list[str]:
    """Read the first `max_chars_per_file` characters of each selected stdlib file."""
    texts: list[str] = []
    for path in stdlib_text_files(num_files):
        try:
            texts.append(path.read_text(encoding="utf-8", errors="replace")[:max_chars_per_file])
        except OSError:
            continue
    return texts


def _train_tokenizer(out_dir: Path, vocab_size: int, seed_text_files: int, max_chars: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_stdlib_text(seed_text_files, max_chars), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "add_bos_token": True, "add_eos_token": False,
        "additional_special_tokens": list(CHAT_MARKERS),
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                   "additional_special_tokens": list(CHAT_MARKERS)}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))


def build_tokenizer(
    out_dir: str | Path, vocab_size: int = 512, seed_text_files: int = 40, max_chars_per_file: int = 20_000
) -> Path:
    """Train (or copy from the in-process cache) a byte-level BPE tokenizer into `out_dir`."""
    out = Path(out_dir)
    key = (vocab_size, seed_text_files, max_chars_per_file)
    cached = _TOKENIZER_CACHE.get(key)
    if cached is None or not (cached / "tokenizer.json").exists():
        cached = _cache_root() / f"tok_{vocab_size}_{seed_text_files}_{max_chars_per_file}"
        _train_tokenizer(cached, vocab_size, seed_text_files, max_chars_per_file)
        _TOKENIZER_CACHE[key] = cached
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != cached.resolve():
        for name in TOKENIZER_FILES:
            shutil.copyfile(cached / name, out / name)
    return out


def special_token_ids(tokenizer_dir: str | Path) -> dict[str, int]:
    """Map every special token string to its id, read from `tokenizer.json`."""
    data = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    return {t["content"]: int(t["id"]) for t in data["added_tokens"]}


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and init of a tiny random checkpoint. `weight_scale` ~ std of the logits."""

    arch: str = "llama"
    num_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    vocab_size: int | None = None
    weight_scale: float = 4.0
    seed: int = 0
    torch_dtype: str = "float32"
    tokenizer_vocab_size: int = 512
    sliding_window: int | None = None
    config_style: str = "v5"  # "v5": rope_parameters; "legacy": transformers 4.x rope_theta/rope_scaling
    head_dim: int | None = None       # explicit head_dim (None: hidden_size // num_heads)
    attention_bias: bool = False      # biases on q/k/v/o (Llama, Qwen3)
    partial_rotary_factor: float | None = None        # Phi-3 / Phi-4-mini: rope on a fraction of head_dim
    original_max_position_embeddings: int | None = None  # Phi-3 longrope: top-level, beside rope_scaling
    extra_config: tuple[tuple[str, Any], ...] | dict[str, Any] = ()  # more config kwargs (Gemma soft-caps, ...)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {self.arch!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size % num_heads and num_heads % num_kv_heads must be 0")
        if self.config_style not in ("v5", "legacy"):
            raise ValueError(f"config_style must be 'v5' or 'legacy', got {self.config_style!r}")
        if isinstance(self.rope_scaling, dict):  # keep the spec hashable
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if isinstance(self.extra_config, dict):
            object.__setattr__(self, "extra_config", tuple(sorted(
                (k, tuple(v) if isinstance(v, list) else v) for k, v in self.extra_config.items())))

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        if self.rope_scaling is None:
            return None
        # longrope factor lists are kept as tuples (hashable spec): HF wants lists
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.rope_scaling}  # type: ignore[misc]


LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
}


def _init_weights(model: Any, spec: TinyModelSpec) -> None:
    """Embeddings ~N(0,1), linears ~N(0,1/fan_in), lm_head ~N(0,(ws)^2/hidden), noisy norms/biases."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    h = spec.hidden_size
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("embed_tokens.weight"):
                std = spec.weight_scale / math.sqrt(h) if spec.tie_word_embeddings else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("lm_head.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * (spec.weight_scale / math.sqrt(h)))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                if spec.tie_word_embeddings and name == "model.norm.weight":
                    # random signs break the h ~ e_cur self-similarity that makes tied models repeat
                    p.mul_(torch.randint(0, 2, p.shape, generator=gen) * 2.0 - 1.0)
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    if spec.tie_word_embeddings:
        model.tie_weights()


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write config.json, model.safetensors, generation_config.json and tokenizer files."""
    import torch
    import transformers

    out = Path(out_dir)
    build_tokenizer(out, vocab_size=spec.tokenizer_vocab_size)
    ids = special_token_ids(out)
    tok_size = len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])
    vocab = spec.vocab_size or tok_size
    if vocab < tok_size:
        raise ValueError(f"vocab_size {vocab} < tokenizer size {tok_size}")
    cfg_name, model_name = ARCHS[spec.arch]
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta, rope_scaling=spec.rope_scaling_dict, rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tie_word_embeddings, bos_token_id=ids[BOS], eos_token_id=ids[EOS],
        pad_token_id=ids[PAD], initializer_range=0.02,
    )
    if spec.head_dim is not None:
        kwargs["head_dim"] = spec.head_dim
    if spec.attention_bias:
        kwargs["attention_bias"] = True
    if spec.partial_rotary_factor is not None:
        kwargs["partial_rotary_factor"] = spec.partial_rotary_factor
    if spec.original_max_position_embeddings is not None:
        kwargs["original_max_position_embeddings"] = spec.original_max_position_embeddings
    kwargs.update({k: list(v) if isinstance(v, tuple) else v for k, v in spec.extra_config})  # type: ignore[misc]
    if spec.arch == "mistral":
        kwargs["sliding_window"] = spec.sliding_window
    elif spec.arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        kwargs["use_sliding_window"] = spec.sliding_window is not None
        kwargs["sliding_window"] = spec.sliding_window
    config = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(spec.seed)
    model = getattr(transformers, model_name)(config)
    _init_weights(model, spec)
    if spec.arch.startswith("gemma"):
        from family_models import gemma_norms

        gemma_norms(model, spec)
    model = model.to(getattr(torch, spec.torch_dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = spec.torch_dtype
    if spec.config_style == "legacy":
        cfg.pop("rope_parameters", None)
        cfg.pop("dtype", None)
        cfg["rope_theta"] = spec.rope_theta
        cfg["rope_scaling"] = spec.rope_scaling_dict
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    gen_cfg = {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    (out / "tiny_spec.json").write_text(json.dumps(asdict(spec), indent=2, default=list))
    return out


def tiny_model_dir(spec: TinyModelSpec = TinyModelSpec(), root: str | Path | None = None) -> Path:
    """Build `spec` once per process (under `root` or a temp dir) and return its directory."""
    base = Path(root) if root is not None else _cache_root()
    key = (spec, str(base.resolve()))
    cached = _MODEL_CACHE.get(key)
    if cached is not None and (cached / "model.safetensors").exists():
        return cached
    digest = hashlib.sha1(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]
    name = f"{spec.arch}_{digest}"
    out = build_tiny_model(base / name, spec)
    _MODEL_CACHE[key] = out
    return out
