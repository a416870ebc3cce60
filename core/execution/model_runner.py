"""Execute: one step's forward on rank 0, and through the executor on every other rank.

The executor gets the step's inputs first (a no-op at one rank), so the workers run the same forward and join the
same collectives in the same order: the forward's own, the prompt log-prob rows' logits gather (here, right
after the forward), then the sampled rows' gather (the sampling stage). A decode-only step replays a decode
graph when one fits, a step with speculative drafts a verification graph (`core/execution/cuda_graphs.py`);
tokens still in flight (async scheduling) are patched into the inputs on the device (`core/execution/pending.py`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from core.distributed.executor import TPExecutor
from core.engine import faults
from core.engine.request import PENDING_TOKEN, Request
from core.execution.cuda_graphs import DecodeGraphRunner, build_decode_graphs
from core.execution.mixed_graphs import MixedGraphRunner, build_mixed_graphs
from core.execution.pending import PendingStep, fixup_to_device
from core.execution.runner import HostBatch, graph_sample_rows, prepare_batch, sample_rows, to_device
from core.execution.step_io import ForwardOutput, StepBatch
from core.sampling.prompt_logprobs import record_prompt_logprobs

if TYPE_CHECKING:
    from core.config import EngineConfig
    from core.engine.setup import EngineParts


class ModelRunner:
    def __init__(self, config: EngineConfig, parts: EngineParts) -> None:
        self.config, self.parts = config, parts
        self.model, self.kv_caches, self.lora_pool = parts.model, parts.kv_caches, parts.lora_pool
        self.executor: TPExecutor = parts.executor
        self.device, self.block_size = parts.device, config.cache.block_size
        self.graphs: DecodeGraphRunner | None = None   # built by `capture_decode_graphs` (CUDA, unless enforce_eager)
        self.mixed: MixedGraphRunner | None = None     # steps with prefill chunks (one rank; built beside `graphs`)

    def capture_decode_graphs(self) -> int:
        """Builds (CUDA) and captures the decode graphs, then the mixed-step graphs in the same memory pool; with
        padded runners installed without graphs (CPU tests) it runs each captured size once. Every
        tensor-parallel worker builds and captures the same decode sizes in the same order (mixed-step graphs
        exist at one rank only). Returns the number of graphs or warm-up forwards."""
        if self.graphs is None:
            self.graphs = build_decode_graphs(self.config, self.parts)
        num = 0
        if self.graphs is not None:
            g = self.graphs
            self.executor.capture_graphs(g.sizes, g.use_graphs, g.lora is not None, g.verify_len, g.verify_sizes)
            num = g.capture()
            if self.mixed is None and g.use_graphs:
                self.mixed = build_mixed_graphs(self.config, self.parts, g.backend)
        if self.mixed is not None:
            num += self.mixed.capture(self.graphs.pool if self.graphs is not None else None)
        return num

    def prepare(self, scheduled: list[tuple[Request, int]]) -> HostBatch:
        """The flat batch of the scheduled (request, new tokens) pairs (`core/execution/runner.py`)."""
        return prepare_batch(scheduled, self.block_size)

    def execute(self, batch: StepBatch, pending: PendingStep | None, share_tokens: bool) -> ForwardOutput:
        """Queues the forward (nothing here waits for the device) and the prompt log-probs of its rows.
        `share_tokens`: the workers get this step's sampled tokens (async scheduling)."""
        host, token_slots, plan = batch.host, batch.token_slots, batch.prompt_plan
        fixup = pending.input_fixup(host) if pending is not None else None
        assert pending is not None or PENDING_TOKEN not in host.token_ids, "a token in flight with no source"
        use_graph = self.graphs is not None and self.graphs.can_run(host, in_flight=fixup is not None)
        use_mixed = not use_graph and self.mixed is not None and self.mixed.can_run(host)
        if faults.ACTIVE:
            faults.hit_any("forward", host.requests)
        # the workers run the same forward (and the same patch of in-flight tokens)
        self.executor.send_step(host, token_slots, use_graph=use_graph, fixup=fixup,
                                prompt_rows=plan.rows if plan is not None else None, share_tokens=share_tokens,
                                logit_rows=batch.drafts.rows if batch.drafts is not None else None)
        self.lora_pool.finish_dora()          # DoRA norms of row-parallel shards (a collective; the workers' too)
        dev_fixup = fixup_to_device(fixup, self.device)
        self.lora_pool.context.set_step_slots(token_slots)   # the LM head's LoRA rows (after the forward)
        try:
            on_inputs = (lambda ids: pending.apply_fixup(ids, dev_fixup)) if dev_fixup is not None else None
            if use_graph:
                assert self.graphs is not None
                out = ForwardOutput(self.graphs.run(host, token_slots, on_inputs),       # [B or T, hidden]
                                    graph_sample_rows(host, self.device), sample_rows(host, graph=True))
            elif use_mixed:
                assert self.mixed is not None
                out = ForwardOutput(self.mixed.run(host, token_slots, on_inputs),        # [T, hidden]
                                    graph_sample_rows(host, self.device), sample_rows(host, graph=True))
            else:
                inputs = to_device(host, self.block_size, self.device)
                if dev_fixup is not None:
                    pending.apply_fixup(inputs.input_ids, dev_fixup)
                if token_slots is not None:
                    self.lora_pool.context.set_batch(token_slots)
                out = ForwardOutput(self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta),
                                    inputs.logits_indices, sample_rows(host, graph=False))        # [T, hidden]
        finally:
            self.lora_pool.unpin_all()
            self.lora_pool.context.clear()
        if plan is not None:
            out.prompt_faults = record_prompt_logprobs(self.model, plan, out.hidden, self.lora_pool.context)
        return out

    def release(self) -> None:
        """Drops every reference to device memory (model, KV caches, LoRA slots, decode graphs)."""
        self.graphs = self.mixed = None
        self.model = self.kv_caches = self.lora_pool = self.parts = None  # type: ignore[assignment]
