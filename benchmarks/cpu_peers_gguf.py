"""Runs llama.cpp's convert_hf_to_gguf.py on a loraplex test model (run by the converter's python, not ours).

    python cpu_peers_gguf.py CONVERT_SCRIPT MODEL_DIR --outtype f32 --outfile OUT.gguf

The converter identifies a byte-level BPE tokenizer by hashing how it splits a fixed text and refuses one it
does not know ("BPE pre-tokenizer was not recognized"); the tokenizers of tests/helpers/tiny_models.py and of
the embedded demo model are trained here, so no hash matches. Their pre-tokenizer is GPT-2's (ByteLevel with
the GPT-2 regex, no prefix space), so an unknown hash is mapped to "gpt-2". The benchmark sends token ids, so
llama.cpp only detokenizes with it. Everything else is the converter's own `main()`.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _patch_pre_tokenizer() -> int:
    """Makes every loaded `get_vocab_base_pre` answer "gpt-2" where it would raise; returns how many it patched."""
    patched = 0
    for module in list(sys.modules.values()):
        cls = vars(module).get("TextModel")   # not getattr: lazy modules (transformers) would import on it
        if not isinstance(cls, type) or "get_vocab_base_pre" not in vars(cls) or \
                getattr(cls.get_vocab_base_pre, "_peers_patched", False):
            continue
        original = cls.get_vocab_base_pre

        def get_vocab_base_pre(self, tokenizer, _original=original) -> str:   # noqa: ANN001
            try:
                return _original(self, tokenizer)
            except NotImplementedError:
                return "gpt-2"

        get_vocab_base_pre._peers_patched = True   # type: ignore[attr-defined]
        cls.get_vocab_base_pre = get_vocab_base_pre
        patched += 1
    return patched


def main() -> None:
    script = Path(sys.argv[1]).resolve()
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["convert_hf_to_gguf"] = module
    spec.loader.exec_module(module)   # defines main(); its `if __name__ == "__main__"` does not fire
    if not _patch_pre_tokenizer():
        raise SystemExit(f"no TextModel.get_vocab_base_pre found in {script}: the converter's layout changed")
    module.main()


if __name__ == "__main__":
    main()
