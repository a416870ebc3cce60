"""Tokens sampled on the device and not read back yet: the hand-off of async (overlapped) scheduling.

With async scheduling the engine launches step t+1 before it reads step t's tokens:

    schedule t+1 -> launch forward t+1 (inputs of rows still in flight are taken from step t's token
    tensor on the device) -> read step t's tokens (waits only for step t's sampling, which the device
    finished while the CPU scheduled) -> stops, detokenization, grammar advance -> step t+1's masks
    and sampling -> copy its tokens to pinned host memory and record an event -> return.

So the CPU's per-step work (scheduling, batch building, detokenization, grammar) runs while the GPU
computes, and the only wait is for a step that is already done. A request that step t's token ends
(EOS, a stop string, a grammar) was still computed in step t+1: that row is dropped when read.
Without CUDA the copies are synchronous and `read()` returns at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from core.engine.outputs import TokenLogprob
from core.engine.request import PENDING_TOKEN, Request
from core.execution.runner import HostBatch, host_to_device
from core.sampling.sampler import logprob_entries


Fixup = tuple[np.ndarray, np.ndarray]               # (rows of the new batch, rows of the sampled tokens)
DeviceFixup = tuple[torch.Tensor, torch.Tensor]


def fixup_to_device(fixup: Fixup | None, device: torch.device) -> DeviceFixup | None:
    if fixup is None:
        return None
    rows, src = fixup
    both = host_to_device(np.concatenate([rows, src]), device)                                  # [2R]
    return both[:len(rows)], both[len(rows):]


def patch_inputs(input_ids: torch.Tensor, tokens: torch.Tensor, fixup: DeviceFixup | None) -> None:
    """Writes the in-flight tokens (sampled on the device, not read yet) into a step's input ids, in stream
    order (the driver from its pending step; tensor-parallel workers from the tokens the driver shared)."""
    if fixup is not None:
        rows, src = fixup
        input_ids.index_copy_(0, rows, tokens.index_select(0, src))


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Starts a device -> host copy (pinned, non-blocking on CUDA); valid once the step's event fired."""
    if not t.is_cuda:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


@dataclass
class PendingStep:
    requests: list[Request]                           # sampled rows, in order
    tokens: torch.Tensor                              # [N] int64 on the device: inputs of the next step
    host_tokens: torch.Tensor                         # [N] host copy (in flight until `event`)
    host_logprobs: tuple[torch.Tensor, ...] | None    # chosen [N], top values [N, k], top ids [N, k]
    event: torch.cuda.Event | None
    row_of: dict[int, int]                            # id(request) -> row

    @staticmethod
    def launch(reqs: list[Request], tokens: torch.Tensor,
               logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> "PendingStep":
        """Queues the copies of a step's sampled tokens (and log-probs) to the host; marks every live
        request as having one token in flight."""
        host_lps = tuple(_to_host(t) for t in logprobs) if logprobs is not None else None
        pending = PendingStep(requests=reqs, tokens=tokens, host_tokens=_to_host(tokens), host_logprobs=host_lps,
                              event=None, row_of={id(r): i for i, r in enumerate(reqs)})
        if tokens.is_cuda:
            pending.event = torch.cuda.Event()
            pending.event.record(torch.cuda.current_stream(tokens.device))
        for r in reqs:
            if not r.status.finished:
                r.append_pending_token()
        return pending

    def input_fixup(self, host: HostBatch) -> Fixup | None:
        """(rows, sources) on the host: batch rows whose input token is in flight, and its row here.
        Only decodes can hold one (a request with a token in flight has exactly one token to compute)."""
        rows = np.nonzero(host.token_ids[:host.num_decode] == PENDING_TOKEN)[0]                 # [R]
        assert PENDING_TOKEN not in host.token_ids[host.num_decode:], "a prefill chunk reads a token in flight"
        if len(rows) == 0:
            return None
        src = np.fromiter((self.row_of[id(host.requests[i])] for i in rows), dtype=np.int64, count=len(rows))
        return rows.astype(np.int64), src

    def apply_fixup(self, input_ids: torch.Tensor, fixup: DeviceFixup | None) -> None:
        patch_inputs(input_ids, self.tokens, fixup)

    def wait(self) -> None:
        """Waits for this step's sampling (not for later work on the stream)."""
        if self.event is not None:
            self.event.synchronize()

    def read(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """This step's tokens and log-prob entries (after `wait`)."""
        self.wait()
        tokens = self.host_tokens.tolist()
        if self.host_logprobs is None:
            return tokens, [None] * len(tokens)
        chosen, vals, ids = self.host_logprobs
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        return tokens, logprob_entries(self.requests, tokens, chosen.tolist(), tops)
