"""Every environment variable the product reads, declared once: name, type, default, meaning (docs/environment.md).

    from core.environment import variables as env
    if env.FUSED_OPS.get() == "torch": ...

`get()` reads the variable on first use and keeps the value for the life of the process: no hot path reads
the environment (the engine process and tensor-parallel workers are spawned, so each reads its own once).
A bad value raises ValueError naming the variable; `loraplex serve` checks them all before it starts
(`check_all`). Tests and benchmarks that change a variable inside one process call `reset()` after it.
No other module of core/, adapters/, grammar/ or gateway/ reads `os.environ` (a test scans for it).
"""
from __future__ import annotations

import os
from typing import Callable, Generic, Mapping, TypeVar

from grammar.compile.limits import MAX_COMPILE_TIMEOUT_S, MIN_REGEX_CHARS, MIN_WORKER_MEMORY_MB

T = TypeVar("T")
_UNSET: object = object()
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class EnvVar(Generic[T]):
    """One variable: `kind` and `default_text` as docs/environment.md writes them, `parse` for a set value."""

    def __init__(self, name: str, kind: str, default: T, default_text: str, doc: str,
                 parse: Callable[[str], T]) -> None:
        self.name, self.kind, self.default, self.default_text, self.doc = name, kind, default, default_text, doc
        self._parse = parse
        self._value: object = _UNSET

    def get(self) -> T:
        """The value in this process's environment, read once (a bad value raises, and is read again next time)."""
        value = self._value
        if value is _UNSET:
            value = self._value = self.read(os.environ)
        return value  # type: ignore[return-value]

    def read(self, environ: Mapping[str, str]) -> T:
        """The value `environ` gives (unset or blank: the default), not cached."""
        raw = environ.get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            return self._parse(raw)
        except ValueError as exc:
            raise ValueError(f"{self.name} {exc}") from None

    def is_set(self) -> bool:
        """Whether this process's environment names a value (an operator's choice, not the default)."""
        return bool(os.environ.get(self.name, "").strip())

    def reset(self) -> None:
        self._value = _UNSET

    def __repr__(self) -> str:
        return f"EnvVar({self.name})"


# ---- parsers: each raises ValueError with the text that follows the variable's name --------------------------
def _choice(*values: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.lower()
        if value not in values:
            raise ValueError(f"must be {', '.join(values[:-1])} or {values[-1]}, not {raw!r}")
        return value
    return parse


def _bool(raw: str) -> bool:
    value = raw.lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"must be 1 or 0 (true/false, yes/no, on/off), not {raw!r}")


def _auto_bool(raw: str) -> bool | None:
    return None if raw.lower() == "auto" else _bool(raw)


def _number(kind: type, raw: str) -> float:
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"must be a number, got {raw!r}") from None


def _seconds(lo_exclusive: float, hi: float) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        value = float(_number(float, raw))
        if not lo_exclusive < value <= hi:
            raise ValueError(f"must be in ({lo_exclusive:g}, {hi:g}] seconds, got {value:g}")
        return value
    return parse


def _worker_memory_mb(raw: str) -> int:
    value = int(_number(int, raw))
    if value != 0 and value < MIN_WORKER_MEMORY_MB:
        raise ValueError(f"must be 0 (no limit) or at least {MIN_WORKER_MEMORY_MB} MiB, got {value}")
    return value


def _regex_chars(raw: str) -> int:
    value = int(_number(int, raw))
    if value < MIN_REGEX_CHARS:
        raise ValueError(f"must be at least {MIN_REGEX_CHARS} characters, got {value}")
    return value


def _hook(raw: str) -> str:
    module, sep, function = raw.partition(":")
    if not (sep and module.strip() and function.strip()):
        raise ValueError(f"must be module:function, not {raw!r}")
    return raw


def _text(raw: str) -> str:
    return raw


# ---- kernel backends (core/environment/backends.py) ----------------------------------------------------------
_BACKEND = "auto|torch|triton"
_BACKEND_DOC = ("auto: the Triton kernels for CUDA tensors when triton imports, the torch path otherwise; torch: "
                "the torch path on any device; triton: the kernels (off CUDA only under TRITON_INTERPRET=1, tests)")
ATTENTION_BACKEND = EnvVar("LORAPLEX_ATTENTION_BACKEND", _BACKEND, "auto", "auto",
                           "paged attention and the KV store. " + _BACKEND_DOC, _choice("auto", "torch", "triton"))
FUSED_OPS = EnvVar("LORAPLEX_FUSED_OPS", _BACKEND, "auto", "auto",
                   "the fused RMSNorm / rotary / SiLU-and-mul ops of the decoder, the FP8 activation "
                   "quantization and the MoE experts' grouped GEMM. " + _BACKEND_DOC,
                   _choice("auto", "torch", "triton"))
LORA_BACKEND = EnvVar("LORAPLEX_LORA_BACKEND", _BACKEND, "auto", "auto",
                      "the LoRA shrink / expand ops (segmented and BGMV). " + _BACKEND_DOC,
                      _choice("auto", "torch", "triton"))
BITMASK_BACKEND = EnvVar("LORAPLEX_BITMASK_BACKEND", _BACKEND, "auto", "auto",
                         "the grammar token-bitmask apply. " + _BACKEND_DOC, _choice("auto", "torch", "triton"))
QUANT_GEMM = EnvVar("LORAPLEX_QUANT_GEMM", _BACKEND, "auto", "auto",
                    "the dequantizing W4A16 / W8A16 GEMM of GPTQ / AWQ / compressed-tensors int checkpoints. "
                    + _BACKEND_DOC, _choice("auto", "torch", "triton"))
KERNEL_SELFCHECK = EnvVar("LORAPLEX_KERNEL_SELFCHECK", "auto|0|1", "auto", "auto",
                          "the start-up self-check of every Triton kernel variant against its torch path: auto = on "
                          "for CUDA engines, 1 = wherever Triton kernels run (also the interpreter), 0 = off",
                          _choice("auto", "0", "1"))
CPU_PACKED_LINEAR = EnvVar("LORAPLEX_CPU_PACKED_LINEAR", "auto|0|1", "auto", "auto",
                           "the CPU linears over weights reordered once for oneDNN (core/models/cpu_linear.py): auto "
                           "and 1 = on for fp32 and bf16 weights where this torch build has oneDNN, 0 = off (F.linear)",
                           _choice("auto", "0", "1"))
NATIVE_KERNELS = EnvVar("LORAPLEX_NATIVE_KERNELS", "auto|0|1", "auto", "auto",
                        "the C kernels of the CPU path (core/native/build.py: CPU paged decode and prefill attention, "
                        "rotary), built at "
                        "first use with the system C compiler into ~/.cache/loraplex/native/: auto and 1 = on where a "
                        "compiler builds them (else the torch path, with a warning), 0 = off (the torch path)",
                        _choice("auto", "0", "1"))
CPU_MALLOC_TUNING = EnvVar("LORAPLEX_CPU_MALLOC_TUNING", "0|1", True, "1",
                           "a CPU engine raises glibc's mmap threshold to 256 MiB and its trim threshold to 1 GiB "
                           "at start-up (core/native/allocator.py), so large activations reuse heap pages instead "
                           "of being mapped and zero-filled afresh every step (the process keeps its peak "
                           "activation memory); 0 = the C library's defaults", _bool)
TRITON_INTERPRET = EnvVar("TRITON_INTERPRET", "0|1", False, "0",
                          "Triton's own switch (read here once, never set): its kernels run in the CPU interpreter "
                          "(tests); a kernel module reads it when it is imported", _bool)

# ---- engine --------------------------------------------------------------------------------------------------
ASYNC_SCHEDULING = EnvVar("LORAPLEX_ASYNC_SCHEDULING", "auto|0|1", None, "auto",
                          "the default of --async-scheduling auto (launch step t+1 before reading step t's tokens): "
                          "auto = on with CUDA; the flag, when on or off, wins", _auto_bool)
ALLOW_LONG_MAX_MODEL_LEN = EnvVar("LORAPLEX_ALLOW_LONG_MAX_MODEL_LEN", "0|1", False, "0",
                                  "1: a --max-model-len above the model's context is a warning instead of a start-up "
                                  "error (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN)", _bool)
TP_START_TIMEOUT_S = EnvVar("LORAPLEX_TP_START_TIMEOUT_S", "seconds", 900.0, "900",
                            "how long tensor-parallel workers may take to load the model and report ready",
                            _seconds(0, 86400))
TP_STEP_TIMEOUT_S = EnvVar("LORAPLEX_TP_STEP_TIMEOUT_S", "seconds", 120.0, "120",
                           "how long one collective may wait for the other tensor-parallel ranks before the engine "
                           "fails (a hung rank becomes an error, not a hang)", _seconds(0, 86400))
MIXED_GRAPHS = EnvVar("LORAPLEX_MIXED_GRAPHS", "0|1", True, "1",
                      "CUDA graphs for steps that carry prefill chunks (one per padded token count up to 1024, "
                      "core/execution/mixed_graphs.py) beside the decode graphs; 0 = such steps run eagerly",
                      _bool)
LORA_OVERLAP = EnvVar("LORAPLEX_LORA_OVERLAP", "0|1", True, "1",
                      "1: with the LoRA kernels on a single GPU, each fused linear's decode LoRA (the CUDA-graph "
                      "path) runs as a delta on a side stream beside the base GEMM, added after it "
                      "(adapters/lora_ops/bgmv_overlap.py; results bit for bit the same); 0: after the GEMM "
                      "(H200, 2026-11-27f: the 64-row decode step 7.44 / 8.33 ms with 8 adapters, 9.50 / 10.07 ms "
                      "with 32)",
                      _bool)
ENGINE_PROCESS = EnvVar("LORAPLEX_ENGINE_PROCESS", "0|1", True, "1",
                        "the default of --engine-process: 1 = the engine core in its own process, 0 = a thread "
                        "of the API process; the flag wins", _bool)

STEP_TRACE = EnvVar("LORAPLEX_STEP_TRACE", "path", None, "unset",
                    "a file the engine appends one JSON line to per step: what it carried, its predicted and "
                    "measured time and the budget its prefill chunks were sized to (core/engine/step_trace.py)",
                    _text)

# ---- grammar compile limits (grammar/compile/limits.py; read by core/engine and gateway) ---------------------
GRAMMAR_COMPILE_TIMEOUT_S = EnvVar("LORAPLEX_GRAMMAR_COMPILE_TIMEOUT_S", "seconds", None, "10",
                                   "CPU seconds one constraint's compile may take in its worker (wall-clock "
                                   "backstop 4x); past it: 400 grammar_compile_timeout",
                                   _seconds(0, MAX_COMPILE_TIMEOUT_S))
GRAMMAR_WORKER_MEMORY_MB = EnvVar("LORAPLEX_GRAMMAR_WORKER_MEMORY_MB", "MiB", None, "4096",
                                  "memory limit of each grammar compile worker (0: none; else at least "
                                  f"{MIN_WORKER_MEMORY_MB})", _worker_memory_mb)
GRAMMAR_MAX_REGEX_CHARS = EnvVar("LORAPLEX_GRAMMAR_MAX_REGEX_CHARS", "characters", None, "by vocabulary size",
                                 "the most characters a JSON schema's regex may have (at least "
                                 f"{MIN_REGEX_CHARS})", _regex_chars)

# ---- tests only ----------------------------------------------------------------------------------------------
ENGINE_TEST_HOOK = EnvVar("LORAPLEX_ENGINE_TEST_HOOK", "module:function", None, "unset",
                          "test suite only: a function of a module in the repository's tests/ folder, called in "
                          "the engine process before the engine is built; refused (the engine does not start) "
                          "unless LORAPLEX_TESTS_DIR names that folder", _hook)
TESTS_DIR = EnvVar("LORAPLEX_TESTS_DIR", "path", None, "unset",
                   "set by tests/conftest.py only: the repository's tests/ folder, the one place test hooks may "
                   "come from", _text)

ALL: tuple[EnvVar, ...] = (
    ATTENTION_BACKEND, FUSED_OPS, LORA_BACKEND, BITMASK_BACKEND, QUANT_GEMM, KERNEL_SELFCHECK, CPU_PACKED_LINEAR,
    NATIVE_KERNELS, CPU_MALLOC_TUNING, TRITON_INTERPRET,
    ASYNC_SCHEDULING, ALLOW_LONG_MAX_MODEL_LEN, TP_START_TIMEOUT_S, TP_STEP_TIMEOUT_S, MIXED_GRAPHS, LORA_OVERLAP,
    ENGINE_PROCESS,
    STEP_TRACE,
    GRAMMAR_COMPILE_TIMEOUT_S, GRAMMAR_WORKER_MEMORY_MB, GRAMMAR_MAX_REGEX_CHARS, ENGINE_TEST_HOOK, TESTS_DIR,
)


def check_all(environ: Mapping[str, str] | None = None) -> list[str]:
    """The error of every variable `environ` (default: this process's) sets to a bad value."""
    env = os.environ if environ is None else environ
    errors = []
    for var in ALL:
        try:
            var.read(env)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def reset() -> None:
    """Forgets every value read, so the next `get()` reads the environment again (tests, benchmarks)."""
    for var in ALL:
        var.reset()
