"""`loraplex serve --config FILE`: vLLM's YAML file of serve flags, expanded into the command line before parsing.

    # serve.yaml                                    loraplex serve --config serve.yaml --port 9000
    model: meta-llama/Llama-3.1-8B-Instruct
    port: 8000
    max-model-len: 8192                             (or max_model_len)
    enable-prefix-caching: true                     (a switch: true adds it, false leaves it out or says --no-...)
    lora-modules:                                   (a list: the flag's values in order)
      - '{"name": "acme", "path": "/adapters/acme"}'
    speculative-config: {"method": "ngram", "num_speculative_tokens": 4}   (a mapping: its JSON)

Each key is a flag of `loraplex serve` (dashes or underscores); `model` is the positional model. The file's flags
come first and the command line's after them, so a flag given on both wins from the command line (vLLM's order);
a model named on the command line replaces the file's. An unknown key, a value of the wrong shape or a file that
is not a YAML mapping stops the start-up with the reason, never an ignored setting.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

MAX_CONFIG_BYTES = 1 << 20     # a flags file, not a data file


def _config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    """The --config value and argv without it."""
    rest: list[str] = []
    path: str | None = None
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a file")
            path, i = argv[i + 1], i + 2
            continue
        if token.startswith("--config="):
            path = token.split("=", 1)[1]
        else:
            rest.append(token)
        i += 1
    return path, rest


def _load(path: str) -> dict[str, Any]:
    import yaml   # only when a config file is given

    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"--config: cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(f"--config: {path} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ValueError(f"--config: {path} is not YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ValueError(f"--config: {path} must be a mapping of flag names to values")
    return data


def _flags(serve: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """`--flag` -> its action, for every long option of the serve parser."""
    return {opt: action for action in serve._actions for opt in action.option_strings if opt.startswith("--")}


def _scalar(key: str, value: Any) -> str:
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, (list, tuple)) or value is None:
        raise ValueError(f"--config: {key}: expected one value, got {value!r}")
    return str(value).lower() if isinstance(value, bool) else str(value)


def _tokens(key: str, value: Any, flags: dict[str, argparse.Action]) -> list[str]:
    flag = "--" + key.replace("_", "-")
    action = flags.get(flag)
    if action is None or flag == "--config":
        raise ValueError(f"--config: unknown flag {key!r} (the keys are `loraplex serve` flags, e.g. max-model-len)")
    if isinstance(action, argparse.BooleanOptionalAction):   # --flag / --no-flag
        if not isinstance(value, bool):
            raise ValueError(f"--config: {key}: true or false, got {value!r}")
        return [flag if value else "--no-" + flag[2:]]
    if action.nargs == 0:   # a switch (store_true / store_const)
        if not isinstance(value, bool):
            raise ValueError(f"--config: {key} is a switch: true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(value, list):
        if action.nargs not in ("+", "*"):
            raise ValueError(f"--config: {key} takes one value, got a list")
        return [flag, *(_scalar(key, v) for v in value)] if value else []
    return [flag, _scalar(key, value)]


def expand_config(argv: list[str], serve: argparse.ArgumentParser) -> list[str]:
    """`argv` (after `serve`) with `--config FILE` replaced by the file's flags, ahead of the command line's."""
    path, rest = _config_path(argv)
    if path is None:
        return argv
    data = _load(path)
    flags = _flags(serve)
    tokens: list[str] = []
    model = data.pop("model", None)
    for key, value in data.items():
        tokens += _tokens(key, value, flags)
    probe, _ = serve.parse_known_args(rest)   # is a model named on the command line?
    if model is not None and probe.model_tag is None and probe.model is None:
        tokens += ["--model", _scalar("model", model)]
    if rest and not rest[0].startswith("-"):   # `serve MODEL ...`: the model first, not after a list flag's values
        return [rest[0], *tokens, *rest[1:]]
    return [*tokens, *rest]
