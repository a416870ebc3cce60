"""The path a LoRA op takes (`Backend`: the Triton kernels or the torch reference) and the pair of paths one
slot pool's ops take (`LoRABackends`), as the engine resolved them for the pool's device."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from adapters.lora_ops.bgmv import DecodeLoRAMeta
from adapters.lora_ops.metadata import LoRABatchMeta

Backend = Literal["torch", "triton"]
BACKENDS: tuple[Backend, ...] = ("torch", "triton")


def check_backend(backend: str) -> Backend:
    """`backend` itself when it names a path ("torch" or "triton"), else ValueError."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown LoRA backend {backend!r} (expected torch or triton)")
    return backend  # type: ignore[return-value]


# The most rows a step computes its LoRA as a delta beside the base GEMMs. The delta costs 8 bytes per LoRA output
# element more than the fused expand (a float32 write and read); what it hides is the LoRA launches' latency, a
# fixed ~0.6-0.9 ms a decode step on an H200. By bytes the two meet near 390 rows on the 8B shape (11 MB a row over
# its 32 layers, ~2.3 us at 4.8 TB/s), and the GEMMs of a long chunk are compute-bound, with no memory time to hide
# the traffic under. Measured faster: decode steps of 64 rows and mixed steps of up to 256 (2026-11-27f); longer
# steps keep the fused path until a GPU run measures them.
OVERLAP_MAX_TOKENS = 256


@dataclass(frozen=True)
class LoRABackends:
    """The paths of one pool's LoRA ops, resolved by the engine for the pool's device: `segmented` for the
    grouped metadata of prefill and mixed steps (`LoRABatchMeta`), `decode` for the fused decode (BGMV) ops of
    padded decode batches (`DecodeLoRAMeta`, the CUDA-graph path). Triton off CUDA runs only in Triton's CPU
    interpreter (tests); the engine checks that before it names it. `overlap`: the fused decode ops on the kernels
    run as a delta beside the base linear's GEMM (adapters/lora_ops/bgmv_overlap.py; LORAPLEX_LORA_OVERLAP)."""
    segmented: Backend = "torch"
    decode: Backend = "torch"
    overlap: bool = False

    def __post_init__(self) -> None:
        check_backend(self.segmented)
        check_backend(self.decode)

    def for_meta(self, meta: LoRABatchMeta | DecodeLoRAMeta) -> Backend:
        """The path of a step with this metadata."""
        return self.decode if isinstance(meta, DecodeLoRAMeta) else self.segmented

    @property
    def decode_overlap(self) -> bool:
        """Whether the fused decode ops run as deltas beside the base GEMMs: `overlap` on, and those ops on the
        kernels (the torch path has no delta ops)."""
        return self.overlap and self.decode == "triton"

    def overlaps(self, meta: LoRABatchMeta | DecodeLoRAMeta) -> bool:
        """Whether a step with this metadata computes its LoRA as a delta beside the base GEMM: `decode_overlap`,
        and the fused decode metadata (padded decode and mixed-step batches, the CUDA-graph path) of at most
        `OVERLAP_MAX_TOKENS` rows."""
        return self.decode_overlap and isinstance(meta, DecodeLoRAMeta) and meta.num_tokens <= OVERLAP_MAX_TOKENS
