"""Per-step LoRA context shared by every `LoRALinear` of a model.

The runner sets it once per step, before the forward:

    pool.context.set_batch(token_slots)   # one slot per token of the flat batch, -1 = base
    logits = model(...)
    pool.context.clear()                  # optional; a stale batch is caught by a size check

With no batch set (or no LoRA token in it) every wrapper returns the base output untouched. `backends` names the
path the wrappers' ops take (the engine resolves it for the device: core/environment/backends.py).

The LM head runs after the forward, on some rows of the step (the sampled ones, prompt log-prob rows, draft
positions): the runner keeps the step's per-token slots (`set_step_slots`, every step, None without adapters) and
each LM-head call names its rows of the step:

    with pool.context.logit_rows(rows):     # rows of the step's flat batch, in the order of the LM head's input
        logits = model.compute_logits(hidden[rows])

The rows are host indices (a numpy array): the metadata is built on the host, and a device tensor read back here
would make the host wait for the step's forward, so with async scheduling the device would sit idle while the host
schedules the next step. Until 2026-11-27 the sampled rows of eager and mixed-step graph steps came here as a
device tensor: the likely cause of the H200 step trace's 20-24 ms for a step with a prefill chunk (up to 192
tokens) and adapters, against ~12 ms for a decode step with as many adapters; the base model's pair 8.4 and 5.9 ms
(benchmarks/results/gpu_run_h200_2026-11-27/, docs/gpu.md; the fix is not yet measured on a GPU). A torch tensor is refused.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Union

import numpy as np
import torch

from adapters.errors import LoRAContextError
from adapters.lora_ops import LoRABackends, LoRABatchMeta
from adapters.lora_ops.metadata import SlotsLike


class LoRAContext:
    def __init__(self, device: Union[torch.device, str], num_slots: int,
                 backends: LoRABackends = LoRABackends()) -> None:
        self.device = torch.device(device)
        self.num_slots = num_slots
        self.backends = backends
        self._meta: Optional[LoRABatchMeta] = None
        self._step_slots: Optional[np.ndarray] = None      # [T] the step's slot per token (-1: base)
        self._logits_meta: Optional[LoRABatchMeta] = None   # the LM head's rows, while `logit_rows` is open
        self._side_stream: Optional[torch.cuda.Stream] = None   # the LoRA deltas' stream (`backends.overlap`)

    @property
    def meta(self) -> Optional[LoRABatchMeta]:
        return self._meta

    @property
    def active(self) -> bool:
        """True when the current step has at least one LoRA token."""
        return self._meta is not None and self._meta.has_lora

    def set_batch(self, token_slots: SlotsLike) -> LoRABatchMeta:
        """Build and install the step's metadata from per-token slots (host list / CPU tensor)."""
        meta = LoRABatchMeta.build(token_slots, self.device, num_slots=self.num_slots)
        self._meta = meta
        return meta

    def set_meta(self, meta: Optional[LoRABatchMeta]) -> None:
        if meta is not None and meta.has_lora and meta.device.type != self.device.type:
            raise ValueError(f"LoRA metadata on {meta.device}, model on {self.device}")
        self._meta = meta

    def clear(self) -> None:
        self._meta = None

    def side_stream(self) -> Optional[torch.cuda.Stream]:
        """The stream the wrappers run LoRA deltas on beside the base GEMMs (`backends.overlap`; one per pool, made
        on first use); None off CUDA (Triton's CPU interpreter: the delta runs in turn, tests)."""
        if self.device.type != "cuda":
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        return self._side_stream

    # ---- the LM head's rows ------------------------------------------------------------------
    def set_step_slots(self, token_slots: Optional[np.ndarray]) -> None:
        """The step's per-token slots (None: no adapter in the step), kept for the LM-head calls after the forward."""
        self._step_slots = None if token_slots is None else np.asarray(token_slots, dtype=np.int64)

    @property
    def step_has_lora(self) -> bool:
        return self._step_slots is not None and bool((self._step_slots >= 0).any())

    @contextmanager
    def logit_rows(self, rows: Optional[np.ndarray]) -> Iterator[None]:
        """While open, the LM head's input rows are these rows of the step (host indices; None: every row of the
        step)."""
        if isinstance(rows, torch.Tensor):
            raise LoRAContextError("the LM head's rows must be host indices: reading a device tensor back would wait "
                                   "for the step's forward")
        if not self.step_has_lora:
            yield
            return
        assert self._step_slots is not None
        if rows is None:
            slots = self._step_slots
        else:
            idx = np.asarray(rows, dtype=np.int64)
            if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= len(self._step_slots)):
                raise LoRAContextError(f"LM-head rows outside the step's {len(self._step_slots)} tokens")
            slots = self._step_slots[idx]
        self._logits_meta = LoRABatchMeta.build(torch.from_numpy(slots), self.device, num_slots=self.num_slots)
        try:
            yield
        finally:
            self._logits_meta = None

    def logits_meta(self, num_rows: int) -> Optional[LoRABatchMeta]:
        """The LM head's metadata for an input of `num_rows` rows (None: no LoRA row). A step with adapters whose LM
        head runs without `logit_rows` is a bug: it raises rather than drop the adapters' LM-head LoRA."""
        meta = self._logits_meta
        if meta is None:
            if self.step_has_lora:
                raise LoRAContextError("the LM head ran on a step with adapters without naming its rows")
            return None
        meta.check_num_tokens(num_rows)
        return meta if meta.has_lora else None
