"""The served multi-LoRA cases shared by the HTTP LoRA and speculative-decoding tests: the tiny Llama, its
prompts, and the PEFT greedy text a served greedy completion must equal.

    assert norm_text(choice.text) == reference_text("qv_r4", PROMPTS[0])     # None: the bare base model
"""
from __future__ import annotations

from lora_fixtures import peft_text

MODEL = "llama_gqa"
MAX_TOKENS = 12
PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n",
    "class Cache:\n    def __init__(self, size):\n        self.size = size\n",
    "while True:\n    line = stream.readline()\n",
]


def reference_text(adapter: str | None, prompt: str) -> str:
    """PEFT (or bare base) greedy continuation of `prompt` (MAX_TOKENS tokens), decoded by the model's tokenizer."""
    return peft_text(MODEL, adapter, prompt, MAX_TOKENS)
