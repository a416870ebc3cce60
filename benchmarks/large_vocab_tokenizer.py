"""A 128k-token byte-level BPE tokenizer trained locally (no download) for grammar benchmarks.

Python's stdlib alone has too few distinct words for 128k merges, so the trainer also reads the `.py`, `.md`,
`.rst` and `.txt` files of the installed site-packages.  `python benchmarks/large_vocab_tokenizer.py OUT_DIR`.
"""
from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the packages first: tests/grammar/ would shadow grammar/
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))   # test-model builders: tests/helpers/tiny_models.py
from tiny_models import BOS, EOS, PAD, SPECIAL_TOKENS

SUFFIXES = {".py", ".md", ".rst", ".txt", ".pyi", ".c", ".h", ".cpp"}


def corpus(max_bytes: int) -> Iterator[str]:
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    total = 0
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.suffix not in SUFFIXES or not path.is_file():
                continue
            try:
                text = path.read_text(encoding="utf-8", errors="replace")[:400_000]
            except OSError:
                continue
            total += len(text)
            yield text
            if total >= max_bytes:
                return


def build_large_tokenizer(out_dir: str | Path, vocab_size: int = 128_000, max_bytes: int = 400 << 20) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    if (out / "tokenizer.json").exists():
        return out
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(max_bytes), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
              "unk_token": None, "model_max_length": 1_000_000, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


if __name__ == "__main__":
    path = build_large_tokenizer(sys.argv[1])
    from transformers import AutoTokenizer

    print(path, len(AutoTokenizer.from_pretrained(path)))
