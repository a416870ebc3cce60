"""The one decision of where the suite's Triton kernels run (tests/helpers/kernel_device.py): CUDA tensors and
compiled kernels when `torch.cuda.is_available()`, else CPU tensors and the Triton interpreter; and no test file
deciding it for itself (asking CUDA directly, setting TRITON_INTERPRET, re-importing a kernel module), which is
how the GPU run of the `gpu` files came to hand CPU tensors to compiled kernels."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import kernel_device as kd

TESTS = Path(__file__).resolve().parents[1]
OWN_DECISION = re.compile(r"cuda\.is_available\(|environ(\.setdefault\(|\[)\s*[\"']TRITON_INTERPRET"
                          r"|setenv\(\s*[\"']TRITON_INTERPRET|importlib\.reload\(.*(triton|fused_ops|bgmv)")


def test_cuda_present_means_cuda_tensors_and_compiled_kernels(monkeypatch: pytest.MonkeyPatch,
                                                             request: pytest.FixtureRequest) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kd.kernel_device() == torch.device("cuda")
    assert request.getfixturevalue("kernel_device") == torch.device("cuda")   # the fixture of tests/conftest.py
    environ: dict[str, str] = {}
    assert kd.use_interpreter_without_gpu(environ) is False
    assert "TRITON_INTERPRET" not in environ, "with a GPU the kernels must compile, never run interpreted"


def test_no_cuda_means_cpu_tensors_and_the_interpreter(monkeypatch: pytest.MonkeyPatch,
                                                       request: pytest.FixtureRequest) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kd.kernel_device() == torch.device("cpu")
    assert request.getfixturevalue("kernel_device") == torch.device("cpu")
    environ: dict[str, str] = {}
    assert kd.use_interpreter_without_gpu(environ) is True and environ == {"TRITON_INTERPRET": "1"}
    environ = {"TRITON_INTERPRET": "0"}                # a value the user set is kept
    kd.use_interpreter_without_gpu(environ)
    assert environ == {"TRITON_INTERPRET": "0"}


def test_this_session_decided_once_before_triton_was_imported() -> None:
    """The conftest asked before any test module imported triton: the kernels were decorated accordingly."""
    from core.attention import triton_kernels
    from core.environment.backends import interpreting

    decorated_interpreted = type(triton_kernels.paged_attention_kernel).__name__ == "InterpretedFunction"
    assert interpreting() == decorated_interpreted == (kd.kernel_device().type == "cpu")


def test_no_test_file_decides_the_kernel_device_itself() -> None:
    allowed = {TESTS / "conftest.py", TESTS / "helpers" / "kernel_device.py", Path(__file__).resolve()}
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.resolve() in allowed:
            continue
        for num, line in enumerate(path.read_text().splitlines(), 1):
            if OWN_DECISION.search(line):
                offenders.append(f"{path.relative_to(TESTS.parent)}:{num}: {line.strip()}")
    assert not offenders, "use kernel_device (tests/helpers/kernel_device.py) instead:\n" + "\n".join(offenders)
