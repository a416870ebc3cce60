"""Loads the model folder's tokenizer as `AutoTokenizer.from_pretrained` does, in a fraction of the time.

transformers' AutoTokenizer reads the model's config only for a few plain fields (`model_type`, a declared
`tokenizer_class`, `model_name`, the folder name) to pick the tokenizer class. Loading that config through
`AutoConfig` imports the architecture's configuration module, which in transformers 5 pulls in the modelling
integrations (torch._dynamo, torch.distributed.tensor): about 2-3 s of every server start on a CPU, for
nothing we use. Where tokenizer_config.json declares its `tokenizer_class` (every tokenizer saved by
transformers does), we hand AutoTokenizer a plain `PreTrainedConfig` carrying those fields instead:
transformers' own code then chooses the same class. Anything else falls back to the plain call.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedConfig


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def light_config(model_dir: Path) -> Any | None:
    """A plain `PreTrainedConfig` with the fields AutoTokenizer reads, or None where AutoTokenizer would also look
    at the config's class: no `tokenizer_class` declared in tokenizer_config.json (the class then comes from the
    architecture's mapping), remote code (`auto_map`), or no `model_type`."""
    model, tok = _read_json(model_dir / "config.json"), _read_json(model_dir / "tokenizer_config.json")
    if model is None or tok is None or "auto_map" in model or "auto_map" in tok or "configuration_files" in model:
        return None   # remote code; or AutoConfig would read another config file
    if not isinstance(model.get("model_type"), str) or not isinstance(tok.get("tokenizer_class"), str):
        return None
    config = PreTrainedConfig()
    config.model_type = model["model_type"]
    config._name_or_path = str(model_dir)
    for key in ("tokenizer_class", "model_name"):   # both steer AutoTokenizer's choice of class
        if key in model:
            setattr(config, key, model[key])
    return config


def load_tokenizer(model_dir: Path, trust_remote_code: bool = False) -> Any:
    """`trust_remote_code` lets a tokenizer that ships its own Python (auto_map) run it, as vLLM's flag does."""
    config = light_config(model_dir)
    kwargs = {"trust_remote_code": True} if trust_remote_code else {}
    if config is None:
        return AutoTokenizer.from_pretrained(str(model_dir), **kwargs)
    return AutoTokenizer.from_pretrained(str(model_dir), config=config, **kwargs)
