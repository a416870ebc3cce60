"""Start-up kernel self-check: each Triton kernel variant the warm-up launches is compared with its torch path.

Users run GPUs (and driver / Triton / PTX-compiler versions) our tests never see; a kernel miscompiled there
would serve wrong tokens without a single error. Inside the start-up warm-up (`core/startup/warmup.py`), every
variant runs on random inputs laid out exactly like the real step's (shapes, dtypes, strides, 16-byte
alignments: so it is the same compiled variant), and the torch path runs on the same inputs
(`core/startup/kernel_checks.py`): paged attention (KV store, then decode / mixed, with and without split-KV),
the fused RMSNorm / rotary / SiLU-and-mul, LoRA segmented shrink and expand at every table config, the
BGMV shrink and expand (the two halves of `adapters/lora_ops/bgmv_split.py`), the grammar bitmask apply.
A mismatch raises `KernelSelfCheckError` naming the kernel, its error, the tolerance and the switch that
runs that part on the torch path; the server then exits non-zero instead of serving.

Tolerance: max |triton - torch| <= rtol * max |torch| over the output (a NaN, or an infinity where the
reference has none, always fails), rtol by the model's dtype (`RTOL`): the two paths round differently
(reduction order, where bf16 intermediates round), never by more than a few units in the last place of
the largest value; a miscompile is far outside. The bitmask apply is exact (rtol 0).

`LORAPLEX_KERNEL_SELFCHECK`: unset or `auto` = on for CUDA engines, `1` = on wherever Triton kernels run
(also the CPU interpreter, TRITON_INTERPRET=1: tests), `0` = off.
Not compared: the launches inside the decode CUDA graphs (captured, not run eagerly) and the other ranks
of tensor parallelism (rank 0 checks its own shard's kernels).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from core.environment.backends import FAMILIES
from core.environment.variables import KERNEL_SELFCHECK

log = logging.getLogger("loraplex.kernels")

# rtol of the comparison by the model's dtype (see the module docstring)
RTOL: dict[torch.dtype, float] = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}

# kernel family (core/environment/backends.py) -> what it covers; its switch set to torch runs it on the torch path
CHECKED_FAMILIES: dict[str, str] = {
    "attention": "paged attention",
    "fused": "the fused RMSNorm / rotary / SiLU-and-mul ops",
    "lora": "the LoRA ops",
    "bitmask": "the grammar bitmask apply",
}


class KernelSelfCheckError(RuntimeError):
    """A Triton kernel disagrees with its torch reference on this machine: the engine refuses to start."""

    def __init__(self, failures: list["KernelCheck"], num_checks: int, device: str) -> None:
        self.failures = failures
        lines = [f"kernel self-check failed on {device}: {len(failures)} of {num_checks} Triton kernel checks "
                 f"differ from the torch reference, so this server would produce wrong tokens:"]
        for f in failures:
            lines.append(f"  {f.kernel}: max abs error {f.max_abs_error:.3g} > tolerance {f.tolerance:.3g} "
                         f"(inputs {f.dtype}); run {CHECKED_FAMILIES[f.family]} on the torch path with "
                         f"{FAMILIES[f.family].name}=torch")
        lines.append("Set the switch(es) above and start again (or LORAPLEX_KERNEL_SELFCHECK=0 to skip the "
                     "check: not recommended), and please report the GPU, driver and Triton version.")
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class KernelCheck:
    kernel: str           # kernel name and variant, e.g. "paged_attention_kernel [decode+split]"
    family: str           # key of CHECKED_FAMILIES
    dtype: str
    max_abs_error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_error <= self.tolerance


def selfcheck_enabled(device: torch.device) -> bool:
    """LORAPLEX_KERNEL_SELFCHECK: auto (CUDA only), 1 (wherever Triton kernels run), 0 (never)."""
    choice = KERNEL_SELFCHECK.get()
    return choice == "1" or (choice == "auto" and device.type == "cuda")


def max_abs_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want|, max |want| over its finite values); equal entries (infinities included) count 0,
    a NaN or an infinity on one side only counts inf."""
    assert got.shape == want.shape, f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}"
    g, w = got.detach().float(), want.detach().float()
    diff = torch.where(g == w, torch.zeros_like(g), (g - w).abs())
    diff = torch.nan_to_num(diff, nan=float("inf"), posinf=float("inf"))
    finite = w[torch.isfinite(w)]
    err = float(diff.max()) if diff.numel() else 0.0
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return err, scale


class KernelSelfCheck:
    """Collects the comparisons of one warm-up; `raise_on_failure` turns mismatches into the start-up error."""

    def __init__(self) -> None:
        self.checks: list[KernelCheck] = []

    def compare(self, kernel: str, family: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype,
                exact: bool = False) -> None:
        """Records got (the Triton output) against want (the torch path's), at `dtype`'s tolerance."""
        assert family in CHECKED_FAMILIES, family
        err, scale = max_abs_error(got, want)
        tol = 0.0 if exact else RTOL.get(dtype, RTOL[torch.float32]) * scale
        self.checks.append(KernelCheck(kernel, family, str(dtype).removeprefix("torch."), err, tol))

    @property
    def failures(self) -> list[KernelCheck]:
        return [c for c in self.checks if not c.ok]

    def raise_on_failure(self, device: torch.device) -> None:
        failures = self.failures
        if failures:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
            raise KernelSelfCheckError(failures, len(self.checks), name)
