"""The engine: owns the model, the KV pool, the scheduler; `step()` runs one iteration."""
from __future__ import annotations

import dataclasses
import logging
import random
from typing import Any

import numpy as np
import torch

from adapters.registry.registry import LoadedAdapter
from adapters.slots.slot_fill import SlotFiller
from core.engine import faults
from core.config import EngineConfig
from core.errors import RequestFault
from core.sampling.detokenizer import IncrementalDetokenizer
from core.engine.setup import EngineParts, build_engine_parts
from core.engine.grammar_compilers import GrammarCompilers
from core.engine.outputs import RequestDelta
from core.engine.request import PENDING_TOKEN, Request, RequestStatus
from core.execution.cuda_graphs import DecodeGraphRunner, build_decode_graphs
from core.execution.lora_step import lora_token_slots, pump_adapter_loads
from core.models.rope import rope_namespace, rope_row_offset
from core.sampling.penalties import PenaltyState
from core.scheduling.admission import check_prompt_ids, check_request
from core.sampling.prompt_logprobs import PromptLogprobPlan, plan_prompt_logprobs, record_prompt_logprobs
from core.execution.pending import PendingStep, fixup_to_device
from core.execution.runner import HostBatch, graph_sample_rows, prepare_batch, to_device
from core.sampling.stage import sample_logits, sample_step
from core.sampling.params import SamplingParams
from core.spec.engine_step import DraftLayout, build_spec_decoder, draft_layout, sample_drafts
from core.sampling.stops import append_token, make_delta
from core.engine.fault_isolation import MAX_FAILED_STEPS, drop_unread_tokens, error_delta, fault_of, is_fatal, step_failure
from core.startup.warmup import ProgressFn, WarmupReport, run_warmup
from core.environment.variables import ASYNC_SCHEDULING

log = logging.getLogger("loraplex.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, parts: EngineParts | None = None) -> None:
        self.config = config
        p = parts or build_engine_parts(config)
        self.parts = p
        self.model, self.tokenizer, self.kv_caches = p.model, p.tokenizer, p.kv_caches
        self.device, self.model_config = p.device, p.model_config
        self.scheduler, self.kv = p.scheduler, p.kv
        self.max_model_len, self.eos_token_ids = p.max_model_len, p.eos_token_ids
        self.block_size = config.cache.block_size
        self._rng = random.Random(config.seed)
        self.stats = p.stats
        self.lora_pool, self.registry = p.lora_pool, p.registry
        self.scheduler.on_finish = self._on_finish
        self.scheduler.adapter_ready = self.registry.is_ready   # a request waits while its adapter loads
        self.slot_filler = SlotFiller(self.lora_pool)
        self._grammars = GrammarCompilers(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.tp = p.tp_executor                        # tensor parallel: sends each step to the workers
        self.graphs: DecodeGraphRunner | None = None   # captured by `warmup()` (CUDA, unless enforce_eager)
        self.warmup_report: WarmupReport | None = None
        # overlap the CPU's work for step t+1 with step t on the GPU (default: on CUDA only, where it pays)
        # (--async-scheduling on|off, else LORAPLEX_ASYNC_SCHEDULING 0|1, else on with CUDA)
        async_choice = config.async_scheduling if config.async_scheduling is not None else ASYNC_SCHEDULING.get()
        self.async_scheduling = async_choice if async_choice is not None else self.device.type == "cuda"
        self._pending: PendingStep | None = None       # the last step's tokens, still on the device
        self.penalties = PenaltyState(self.model_config.vocab_size, self.device)
        self._num_failed_steps = 0                     # whole-step failures in a row (core/engine/fault_isolation.py)
        self._step_requests: list[Request] = []        # the requests scheduled in the running step
        self.spec = build_spec_decoder(config, p)      # speculative decoding (core/spec/); None: off
        if self.spec is not None:
            if self.tp is not None:                    # the workers' token sharing follows the engine-wide flag
                self.async_scheduling = False          # (without TP: synchronous only while a request speculates)
            self.stats.spec = self.spec.stats

    # ---- start-up -------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.warmup_report is not None

    def warmup(self, progress: ProgressFn | None = None) -> WarmupReport:
        """Compiles every Triton kernel variant and captures the decode graphs (`core/startup/warmup.py`); call once
        before serving (the offline `LLM` and the server's engine thread do). Later Triton compiles are counted
        as stalls (`core/startup/kernel_compiles.py`)."""
        from core.startup.kernel_compiles import COMPILES

        if self.device.type == "cuda":
            COMPILES.install()
        report = run_warmup(self, progress)
        COMPILES.mark_warmup_end()
        log.info("warm-up: %d kernel variants, %d decode graphs, %d JIT compiles in %.1f s", report.num_variants,
                 report.num_graphs, report.num_jit_compiles, report.seconds)
        self.warmup_report = report
        return report

    def capture_decode_graphs(self) -> int:
        """Builds (CUDA) and captures the decode graphs; with a padded runner installed without graphs (CPU
        tests) it runs each captured size once. Under tensor parallelism every worker builds and captures the
        same sizes in the same order. Returns the number of graphs or warm-up forwards."""
        if self.graphs is None:
            self.graphs = build_decode_graphs(self.config, self.parts)
        if self.graphs is None:
            return 0
        if self.tp is not None:
            self.tp.capture_graphs(self.graphs.sizes, self.graphs.use_graphs, self.graphs.lora is not None)
        return self.graphs.capture()

    # ---- admission ------------------------------------------------------------------------
    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Validates a request against the context and the pool; returns its resolved max_tokens."""
        return check_request(num_prompt_tokens, params, self.max_model_len, self.model_config.vocab_size,
                             self.block_size, self.kv.num_blocks)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora: LoadedAdapter | None = None, grammar: Any = None, tenant: str | None = None,
                    lora_held: bool = False) -> Request:
        """Queues a request; `lora` is a registry entry (None = the base model); `tenant` feeds fair scheduling.
        `lora_held`: the caller already holds `lora` for this request (`registry.acquire`); the request takes
        the hold over, and gives it back if it is rejected."""
        try:
            max_tokens = self.check_request(len(prompt_token_ids), params)
            check_prompt_ids(prompt_token_ids, self.model_config.vocab_size)
            if lora is not None and not lora_held:
                self.registry.acquire(lora)      # an adapter unloaded since its name was resolved: 404
                lora_held = True
            seed = params.seed % (1 << 63) if params.seed is not None else self._rng.getrandbits(63)
            rope_offset = rope_row_offset(self.model_config, self.max_model_len, len(prompt_token_ids) + max_tokens)
            req = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling_params=params,
                          max_tokens=max_tokens, seed=seed, eos_token_ids=self.eos_token_ids,
                          namespace=rope_namespace(lora.namespace if lora is not None else "base", rope_offset),
                          lora_slot_key=lora, grammar=grammar, tenant=tenant, rope_offset=rope_offset)
            # constrained requests never cut their text at stop strings (the grammar ends them)
            detok_params = params if grammar is None else dataclasses.replace(params, stop=())
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, detok_params,
                                                     use_prompt_context=grammar is None)
            if self.spec is not None:
                self.spec.admit(req, len(self.scheduler.requests))
            self.scheduler.add_request(req)
        except BaseException:
            if lora is not None and lora_held:
                self.registry.release(lora)
            raise
        self.stats.num_prompt_tokens += req.num_prompt_tokens
        return req

    def abort_request(self, request_id: str) -> RequestDelta | None:
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        return make_delta(req, [], [], finished=True)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- structured generation ------------------------------------------------------------
    @property
    def grammar_compiler(self) -> Any:
        """The grammar compiler over this tokenizer (built on first use; thread-safe afterwards)."""
        return self._grammars.compiler

    @property
    def schema_options(self) -> Any:
        """Limits of the schema -> regex lowering, scaled to this vocabulary (keeps compiles ~2 s)."""
        return self._grammars.schema_options

    # ---- adapters -------------------------------------------------------------------------
    def load_lora(self, name: str, path: str) -> LoadedAdapter:
        """Reads, validates and registers an adapter (thread-safe; blocking file I/O)."""
        return self.registry.load(name, path)

    def unload_lora(self, name: str) -> None:
        self.registry.unload(name)

    def resolve_lora(self, name: str | None) -> LoadedAdapter | None:
        """A registered adapter, or a `--lora-dir` entry registered now (loaded on first use)."""
        if name is None:
            return None
        entry = self.registry.lookup(name)
        if entry is None:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded")
        return entry

    def _on_finish(self, req: Request) -> None:
        self.penalties.release(req.request_id)
        if req.lora_slot_key is not None:
            self.registry.release(req.lora_slot_key)

    def _release_unloaded_adapters(self) -> None:
        for entry in self.registry.take_released():
            self.lora_pool.unload_adapter(entry.generation_id)
            if self.kv.prefix_cache is not None:
                for offset in (0, 1):    # KV rotated with the short and with the long rope factors
                    self.kv.prefix_cache.clear_namespace(rope_namespace(entry.namespace, offset))

    def _lora_token_slots(self, reqs: list[Request],
                          num_new_tokens: np.ndarray) -> tuple[np.ndarray | None, list[LoadedAdapter]]:
        return lora_token_slots(self.slot_filler, self.registry, reqs, num_new_tokens)

    def _fail_requests(self, reqs: list[Request], message: str,
                       exception: BaseException | None = None) -> list[RequestDelta]:
        deltas = []
        for req in reqs:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            delta = make_delta(req, [], [], finished=True)
            delta.error, delta.exception = message, exception
            deltas.append(delta)
        return deltas

    def _fail(self, req: Request, fault: RequestFault) -> RequestDelta:
        """Ends one request that failed inside the step (its blocks, adapter hold and penalty row freed)."""
        if not req.status.finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return error_delta(req, fault)

    def _pump_adapter_loads(self) -> list[RequestDelta]:
        """Starts the waiting requests' adapter loads (loader pool); fails those whose adapter cannot load."""
        deltas = []
        for req, exc in pump_adapter_loads(self.registry, self.scheduler.waiting):
            msg = f"adapter {req.lora_slot_key.name!r} could not be read: {exc.message}"
            deltas += self._fail_requests([req], msg, exc)
        return deltas

    # ---- one iteration --------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestDelta]:
        """Runs one iteration. With async scheduling it returns the tokens of the step before (see
        `core/execution/pending.py`); otherwise those of this one. A request whose own state raises fails alone; a
        failure of the whole step fails the requests of the step (`core/engine/fault_isolation.py`)."""
        self._release_unloaded_adapters()
        out = self._pump_adapter_loads()
        pending, self._pending = self._pending, None
        self._step_requests = []
        try:
            self._step(pending, out)
            self._num_failed_steps = 0
            return out
        except BaseException as exc:
            drop_unread_tokens(self.scheduler.requests.values())
            if self.spec is not None:
                self.spec.reset(self.scheduler.requests.values())
            self._pending = None
            self._num_failed_steps += 1
            if not isinstance(exc, Exception) or self.tp is not None or is_fatal(exc) \
                    or self._num_failed_steps >= MAX_FAILED_STEPS:
                raise
            return out + [self._fail(r, f) for r, f in step_failure(exc, self._step_requests)]

    def _step(self, pending: PendingStep | None, out: list[RequestDelta]) -> None:
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        self._step_requests = [r for r, _ in sched.scheduled]
        if sched.empty:
            if pending is None:
                self.registry.wait_for_loads(0.02)   # only adapter loads can make progress: do not spin
            self._process(pending, out)
            return
        host = prepare_batch(sched.scheduled, self.block_size)
        token_slots, failed = self._lora_token_slots(host.requests, host.num_new)
        if failed:  # skip this forward: fail the requests of unreadable adapters, the rest run next step
            self._process(pending, out)
            names = ", ".join(sorted({e.name for e in failed}))
            out += self._fail_requests(
                [r for r in host.requests if r.lora_slot_key in failed and not r.status.finished],
                f"the weights of adapter(s) {names} could not be read")
            return
        # Everything up to `pending.read()` is queued on the GPU without waiting for it.
        plan = plan_prompt_logprobs(host)
        drafts = draft_layout(host) if self.spec is not None and self.spec.has_drafts else None
        hidden, rows = self._forward(host, token_slots, pending, plan, drafts)
        if plan is not None:
            out += [self._fail(r, f) for r, f in record_prompt_logprobs(self.model, plan, hidden)]
        self._process(pending, out)     # the previous step's tokens, while this forward runs
        self.scheduler.update_after_step(sched)
        self.stats.record_step(sched.num_batched_tokens, len(host.requests))
        samples, logits = host.samples, None
        if drafts is not None:   # verifies the drafts; the plain rows' logits come from the same LM-head pass
            samples, logits, deltas = sample_drafts(self, host, hidden, drafts)
            out += deltas
        if samples:
            # rows of requests that the previous step's tokens just ended are sampled and dropped when read
            reqs = [host.requests[i] for i in samples]
            tokens, lps, culprits = sample_step(self, reqs, hidden, rows) if logits is None \
                else sample_logits(self, reqs, logits)
            if self.tp is not None and self.async_scheduling:
                self.tp.share_tokens(tokens)     # the workers patch them into the next step's inputs
            out += [self._fail(reqs[i], f) for i, f in culprits.items() if not reqs[i].status.finished]
            self._pending = PendingStep.launch(reqs, tokens, lps)
            # a speculating request's next drafts need this token on the host: no async step while one runs
            if not self.async_scheduling or (self.spec is not None
                                             and self.spec.needs_host_tokens(self.scheduler.running)):
                self._process(self._pending, out)
                self._pending = None

    def _forward(self, host: HostBatch, token_slots: np.ndarray | None, pending: PendingStep | None,
                 plan: PromptLogprobPlan | None,
                 drafts: DraftLayout | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Queues the forward; returns hidden states and the rows to sample (None: every row)."""
        fixup = pending.input_fixup(host) if pending is not None else None
        assert pending is not None or PENDING_TOKEN not in host.token_ids, "a token in flight with no source"
        use_graph = self.graphs is not None and self.graphs.can_run(host)
        if faults.ACTIVE:
            faults.hit_any("forward", host.requests)
        if self.tp is not None:   # the workers run the same forward (and the same patch of in-flight tokens)
            self.tp.send_step(host, token_slots, use_graph=use_graph, fixup=fixup,
                              prompt_rows=plan.rows if plan is not None else None, share_tokens=self.async_scheduling,
                              logit_rows=drafts.rows if drafts is not None else None)
        dev_fixup = fixup_to_device(fixup, self.device)
        try:
            if use_graph:
                on_inputs = (lambda ids: pending.apply_fixup(ids, dev_fixup)) if dev_fixup is not None else None
                hidden = self.graphs.run(host, token_slots, on_inputs)                    # [B, hidden]
                return hidden, graph_sample_rows(host, self.device)
            batch = to_device(host, self.block_size, self.device)
            if dev_fixup is not None:
                pending.apply_fixup(batch.input_ids, dev_fixup)
            if token_slots is not None:
                self.lora_pool.context.set_batch(token_slots)
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)  # [T, hidden]
            return hidden, batch.logits_indices
        finally:
            self.lora_pool.unpin_all()
            self.lora_pool.context.clear()

    def _process(self, pending: PendingStep | None, out: list[RequestDelta]) -> None:
        """Reads a step's tokens and appends them (stops, detokenization, grammar); skips ended requests. A
        request whose token handling raises fails alone."""
        if pending is None:
            return
        tokens, lps = pending.read()
        for r, t, lp in zip(pending.requests, tokens, lps):
            if r.status.finished:
                continue
            try:
                out.append(append_token(r, t, lp, self.max_model_len, self.scheduler.finish, self.stats))
            except Exception as exc:  # noqa: BLE001 - this request's failure
                if is_fatal(exc):
                    raise
                out.append(self._fail(r, fault_of(r, "token handling", exc)))

    def check_integrity(self) -> None:
        if self._pending is None:
            assert all(not r.num_pending_tokens for r in self.scheduler.requests.values()), "a lost token"
        else:
            live = {id(r) for r in self._pending.requests if not r.status.finished}
            assert all(bool(r.num_pending_tokens) == (id(r) in live) for r in self.scheduler.requests.values())
        self.scheduler.check_integrity()
        self.penalties.check_integrity()
        self.registry.check_integrity()
        self.lora_pool.check_integrity(deep=False)
