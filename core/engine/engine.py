"""The engine: owns the executor (the model on every rank), the KV pool and the scheduler; `step()` runs one
iteration: schedule -> execute -> sample -> update (the hand-offs between them: `core/execution/step_io.py`)."""
from __future__ import annotations

import gc
import logging
import random
from typing import Any

import torch

from adapters.registry.registry import LoadedAdapter
from core.config import EngineConfig
from core.engine.fault_isolation import MAX_FAILED_STEPS, error_delta, fault_of, is_fatal, step_failure
from core.engine.grammar_compilers import GrammarCompilers
from core.engine.outputs import RequestDelta
from core.engine.request import Request, RequestStatus
from core.engine.step_clock import CudaEvent, StepClock
from core.engine.step_trace import open_step_trace
from core.engine.setup import EngineParts, build_engine_parts
from core.errors import RequestFault, UnknownAdapter
from core.execution.lora_step import StepAdapters
from core.execution.model_runner import ModelRunner
from core.execution.pending import PendingStep
from core.execution.step_io import ForwardOutput, StepBatch, StepResult
from core.sampling.bad_words import resolve_bad_words
from core.sampling.params import SamplingParams
from core.sampling.stage import SamplingStage
from core.sampling.stops import append_token, make_delta
from core.scheduling.admission import check_priority, check_prompt_ids, check_request, new_request
from core.scheduling.scheduler import SchedulerOutput
from core.spec.engine_step import build_speculator
from core.startup.warmup import ProgressFn, WarmupReport, run_warmup
from core.environment.variables import ASYNC_SCHEDULING, STEP_TRACE

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
        self.executor = p.executor                     # the ranks (one: this process alone)
        self.scheduler.on_finish = self._on_finish
        self.scheduler.adapter_ready = self.registry.is_ready   # a request waits while its adapter loads
        self.adapters = StepAdapters(self.registry, self.lora_pool, self.kv.prefix_cache)
        self._grammars = GrammarCompilers(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.runner = ModelRunner(config, p)           # execute
        self.sampler = SamplingStage(self.model, self.model_config.vocab_size, self.device,     # sample
                                     logit_rows=self.lora_pool.context.logit_rows)
        self.warmup_report: WarmupReport | None = None
        # overlap the CPU's work for step t+1 with step t on the GPU (default: on CUDA only, where it pays)
        # (--async-scheduling on|off, else LORAPLEX_ASYNC_SCHEDULING 0|1, else on with CUDA)
        async_choice = config.async_scheduling if config.async_scheduling is not None else ASYNC_SCHEDULING.get()
        self.async_scheduling = async_choice if async_choice is not None else self.device.type == "cuda"
        self._pending: PendingStep | None = None       # the last step's tokens, still on the device
        self._num_failed_steps = 0                     # whole-step failures in a row (core/engine/fault_isolation.py)
        self._step_requests: list[Request] = []        # the requests scheduled in the running step
        self._closed = False
        self._trace = open_step_trace(STEP_TRACE.get(), self.device)   # LORAPLEX_STEP_TRACE: a JSON line per step
        # speculative decoding (core/spec/): NoSpeculation when off
        self.spec = build_speculator(config, p, self.sampler, self._append, self._fail)
        if self.spec.enabled and self.executor.has_workers:
            # the workers' token sharing follows the engine-wide flag (one rank: synchronous only while a
            # request speculates)
            self.async_scheduling = False
        self.stats.spec = self.spec.stats
        # each step's time as the step-time model learns it (core/engine/step_clock.py): with async scheduling on
        # CUDA an iteration's wall time is the previous step's device time, so device events time each step
        device = self.device
        self._clock: StepClock[SchedulerOutput] = StepClock(
            (lambda: CudaEvent(device)) if self.async_scheduling and device.type == "cuda" else None)

    # ---- start-up -------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.warmup_report is not None

    def warmup(self, progress: ProgressFn | None = None) -> WarmupReport:
        """Compiles every Triton kernel variant and captures the decode graphs (`core/startup/warmup.py`); call once
        before serving (the offline `LLM` and the server's engine thread do)."""
        report = run_warmup(self, progress)
        log.info("warm-up: %d kernel variants, %d decode graphs, %d JIT compiles in %.1f s", report.num_variants,
                 report.num_graphs, report.num_jit_compiles, report.seconds)
        self.warmup_report = report
        return report

    def capture_decode_graphs(self) -> int:
        return self.runner.capture_decode_graphs()

    # ---- admission ------------------------------------------------------------------------
    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Validates a request against the context and the pool; returns its resolved max_tokens."""
        return check_request(num_prompt_tokens, params, self.max_model_len, self.model_config.vocab_size,
                             self.block_size, self.kv.num_blocks)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora: LoadedAdapter | None = None, grammar: Any = None, tenant: str | None = None,
                    lora_held: bool = False, priority: int = 0) -> Request:
        """Queues a request; `lora` is a registry entry (None = the base model); `tenant` feeds fair scheduling;
        `priority` orders requests under the "priority" policy (lower first; any other policy takes only 0).
        `lora_held`: the caller already holds `lora` for this request (`registry.acquire`); the request takes
        the hold over, and gives it back if it is rejected."""
        if self._closed:
            raise RuntimeError("the engine is shut down")
        try:
            params = resolve_bad_words(params, self.tokenizer)   # the offline API's; the server resolves its own
            max_tokens = self.check_request(len(prompt_token_ids), params)
            check_prompt_ids(prompt_token_ids, self.model_config.vocab_size)
            check_priority(priority, self.scheduler.cfg.policy)
            if lora is not None and not lora_held:
                lora = self.registry.acquire(lora)   # unloaded since its name was resolved: 404; replaced: the new
                lora_held = True
            seed = params.seed % (1 << 63) if params.seed is not None else self._rng.getrandbits(63)
            req = new_request(request_id, prompt_token_ids, params, max_tokens=max_tokens, seed=seed,
                              model_config=self.model_config, max_model_len=self.max_model_len,
                              eos_token_ids=self.eos_token_ids, tokenizer=self.tokenizer, lora=lora,
                              grammar=grammar, tenant=tenant, priority=priority)
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

    @property
    def closed(self) -> bool:
        """True once `shutdown` ran."""
        return self._closed

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
    def load_lora(self, name: str, path: str, replace: bool = False) -> LoadedAdapter:
        """Reads, validates and registers an adapter (thread-safe; blocking file I/O); `replace`: over a loaded
        adapter of that name (`AdapterRegistry.load`)."""
        return self.registry.load(name, path, replace)

    def unload_lora(self, name: str) -> None:
        """Removes the name at once; its device slot and cached KV go once no request holds it, between two steps
        (`release_idle` when no request is left)."""
        self.registry.unload(name)

    def release_idle(self) -> None:
        """Frees, with no request left to step, what ended requests and unloaded adapters leave behind until a
        step: the device slot and prefix-cache namespaces of every adapter unloaded (or replaced) that no request
        holds any more, and the draft model's KV of ended requests. On the engine's thread, between two steps (the
        serving loops call it while idle; each step starts the same way): an unload completes when its last
        request ends, not at the next request's step (an idle server kept the slot, `loraplex:lora_adapters_device`
        and the adapter's cached KV)."""
        if self._closed:
            return
        self.adapters.release_unloaded()
        if self.spec.draft is not None:
            self.spec.draft.release_finished()

    def resolve_lora(self, name: str | None) -> LoadedAdapter | None:
        """A registered adapter, or a `--lora-dir` entry registered now (loaded on first use)."""
        if name is None:
            return None
        entry = self.registry.lookup(name)
        if entry is None:
            raise UnknownAdapter(name)
        return entry

    def _on_finish(self, req: Request) -> None:
        self.sampler.release(req.request_id)
        if req.lora_slot_key is not None:
            self.registry.release(req.lora_slot_key)

    # ---- request endings ------------------------------------------------------------------
    def _append(self, req: Request, token: int, logprob: Any) -> RequestDelta:
        """A sampled token into its request: grammar, detokenization, stop checks (`core/sampling/stops.py`)."""
        return append_token(req, token, logprob, self.max_model_len, self.scheduler.finish, self.stats)

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
        for req, exc in self.adapters.failed_loads(self.scheduler.waiting):
            msg = f"adapter {req.lora_slot_key.name!r} could not be read: {exc.message}"
            deltas += self._fail_requests([req], msg, exc)
        return deltas

    # ---- one iteration --------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestDelta]:
        """Runs one iteration. With async scheduling it returns the tokens of the step before (see
        `core/execution/pending.py`); otherwise those of this one. A request whose own state raises fails alone; a
        failure of the whole step fails the requests of the step (`core/engine/fault_isolation.py`) where the
        executor can contain it (one rank), and ends the engine otherwise."""
        if self._closed:
            raise RuntimeError("the engine is shut down")
        self.adapters.release_unloaded()
        out = self._pump_adapter_loads()
        pending, self._pending = self._pending, None
        self._step_requests = []
        try:
            self._step(pending, out)
            self._num_failed_steps = 0
            return out
        except BaseException as exc:
            self.scheduler.drop_unread_tokens()
            self.spec.reset(self.scheduler.requests.values())
            self._pending = None
            self._num_failed_steps += 1
            if not isinstance(exc, Exception) or not self.executor.contains_step_failures or is_fatal(exc) \
                    or self._num_failed_steps >= MAX_FAILED_STEPS:
                raise
            return out + [self._fail(r, f) for r, f in step_failure(exc, self._step_requests)]

    def _step(self, pending: PendingStep | None, out: list[RequestDelta]) -> None:
        """schedule -> execute -> sample -> update. Everything up to `pending.read()` in `_update` is queued on
        the device without waiting for it: the previous step's tokens are read while this step's forward runs."""
        self._clock.begin()
        self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()                                            # schedule
        self._step_requests = [r for r, _ in sched.scheduled]
        batch = self._prepare(sched, pending, out)
        if batch is None:
            return
        fwd = self.runner.execute(batch, pending, share_tokens=self.async_scheduling)  # execute
        out += [self._fail(r, f) for r, f in fwd.prompt_faults]
        self._update(pending, out)     # the previous step's tokens, while this forward runs
        self.scheduler.update_after_step(sched)
        self.stats.record_step(sched.num_batched_tokens, len(batch.host.requests))
        result = self._sample(batch, fwd, out)                                       # sample
        if result is not None:
            self._hand_off(result, out)                                              # update
        # the step-time model learns each step's time once it is known (with async scheduling on CUDA: an
        # iteration later, from the step's device events)
        for done in self._clock.end(sched):
            self.scheduler.observe_step(done.step, done.seconds)
            if self._trace is not None:
                self._trace.record(done.start_s, done.step, done.seconds, done.host_s)

    def _prepare(self, sched: SchedulerOutput, pending: PendingStep | None,
                 out: list[RequestDelta]) -> StepBatch | None:
        """The step's batch; None when no forward runs (nothing scheduled, or an adapter's weights are gone:
        the previous step's tokens are then read and appended here)."""
        if sched.empty:
            if pending is None:
                self.registry.wait_for_loads(0.02)   # only adapter loads can make progress: do not spin
            self._update(pending, out)
            return None
        host = self.runner.prepare(sched.scheduled)
        token_slots, failed = self.adapters.token_slots(host.requests, host.num_new)
        if failed:  # skip this forward: fail the requests of unreadable adapters, the rest run next step
            self._update(pending, out)
            names = ", ".join(sorted({e.name for e in failed}))
            out += self._fail_requests(
                [r for r in host.requests if r.lora_slot_key in failed and not r.status.finished],
                f"the weights of adapter(s) {names} could not be read")
            return None
        return StepBatch.plan(host, token_slots, self.spec.layout(host))

    def _sample(self, batch: StepBatch, fwd: ForwardOutput, out: list[RequestDelta]) -> StepResult | None:
        """The step's tokens, one per sampled row (None: no row samples). A step with drafts verifies them first
        (their deltas go to `out` at once: those tokens are in their requests already), and its plain rows' logits
        come from the same LM-head pass. Rows of requests that the previous step's tokens just ended are sampled
        and dropped when read."""
        rows, logits = batch.host.samples, None
        if batch.drafts is not None:
            verified = self.spec.verify(batch.host, fwd.hidden, batch.drafts)
            out += verified.deltas
            rows, logits = verified.plain, verified.logits
        if not rows:
            return None
        reqs = [batch.host.requests[i] for i in rows]
        return self.sampler.sample_hidden(reqs, fwd.hidden, fwd.rows, fwd.host_rows) if logits is None \
            else self.sampler.sample_logits(reqs, logits)

    def _hand_off(self, result: StepResult, out: list[RequestDelta]) -> None:
        """Update: the sampled tokens stay on the device for the next step's inputs (async scheduling: read next
        step) or are read and appended now."""
        if self.async_scheduling:
            self.executor.share_tokens(result.tokens)     # the workers patch them into the next step's inputs
        reqs = result.requests
        out += [self._fail(reqs[i], f) for i, f in result.failed.items() if not reqs[i].status.finished]
        self._pending = PendingStep.launch(reqs, result.tokens, result.logprobs)
        # a speculating request's next drafts need this token on the host: no async step while one runs
        if not self.async_scheduling or self.spec.needs_host_tokens(self.scheduler.running):
            self._update(self._pending, out)
            self._pending = None

    def _update(self, pending: PendingStep | None, out: list[RequestDelta]) -> None:
        """Reads a step's tokens and appends them (stops, detokenization, grammar); skips ended requests. A
        request whose token handling raises fails alone."""
        if pending is None:
            return
        with self._clock.waiting():     # the device's time, not the host's (core/engine/step_clock.py)
            pending.wait()
        tokens, lps = pending.read()
        for r, t, lp in zip(pending.requests, tokens, lps):
            if r.status.finished:
                continue
            try:
                out.append(self._append(r, t, lp))
            except Exception as exc:  # noqa: BLE001 - this request's failure
                if is_fatal(exc):
                    raise
                out.append(self._fail(r, fault_of(r, "token handling", exc)))

    # ---- shutdown -------------------------------------------------------------------------
    def shutdown(self, graceful: bool = True) -> None:
        """Releases everything the engine holds, once: the adapter loader threads, the grammar compile workers
        (processes) and their threads, the tensor-parallel workers, and every reference to device memory (model,
        KV caches, LoRA slots, decode graphs, penalty rows, the draft model), returned to the device.
        `graceful`: the workers get a stop message (False after a failure: they are killed). The engine cannot
        step afterwards."""
        if self._closed:
            return
        self._closed = True
        if self._trace is not None:
            try:     # the last steps' times (their device events, briefly); not after a failure
                for done in self._clock.drain() if graceful else ():
                    self._trace.record(done.start_s, done.step, done.seconds, done.host_s)
            except Exception as exc:  # noqa: BLE001 - the rest of the shutdown goes on
                log.warning("step trace: the last steps' times are lost (%s)", exc)
            self._trace.close()
        self.registry.shutdown()
        self._grammars.close()
        self.executor.shutdown(graceful=graceful)
        self.runner.release()
        self._pending = None
        self.scheduler.on_finish = None
        self.scheduler.adapter_ready = None
        for name in ("parts", "model", "kv_caches", "lora_pool", "adapters", "sampler", "spec"):
            setattr(self, name, None)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def check_integrity(self) -> None:
        if self._pending is None:
            assert all(not r.num_pending_tokens for r in self.scheduler.requests.values()), "a lost token"
        else:
            live = {id(r) for r in self._pending.requests if not r.status.finished}
            assert all(bool(r.num_pending_tokens) == (id(r) in live) for r in self.scheduler.requests.values())
        self.scheduler.check_integrity()
        self._clock.check_integrity()
        self.sampler.check_integrity()
        self.registry.check_integrity()
        self.lora_pool.check_integrity(deep=False)
