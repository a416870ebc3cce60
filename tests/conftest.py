"""pytest fixtures shared by the whole suite (helpers live in testlib.py)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

# Without a GPU, every Triton kernel in the suite runs in the interpreter; set before anything imports
# triton, so the order test modules are collected in never matters.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from testlib import model_dir


@pytest.fixture(scope="session", params=["llama_gqa", "qwen2_tied"])
def tiny_model(request: pytest.FixtureRequest) -> Path:
    return model_dir(request.param)
