"""Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, in the style of vLLM."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import operator
import weakref
from typing import Any, Sequence, Union

from core.config import (DEMO_MODEL_DIR, CacheConfig, EngineConfig, LoRAConfig, ParallelConfig, QuantizationConfig,
                         SchedulerConfig)
from core.engine.engine import LLMEngine
from core.engine.stats import Metric, engine_metrics
from core.engine.outputs import CompletionOutput, RequestOutput
from core.sampling.bad_words import resolve_bad_words
from core.sampling.params import SamplingParams
from core.scheduling.admission import truncate_prompt
from core.spec.config import SpeculativeConfig
from grammar.matching.matcher import GrammarMatcher
from grammar import parse_response_format

PromptType = Union[str, list[int], dict[str, Any]]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n samples: one sequence each, seeds derived so the n differ yet stay reproducible."""
    seed = None if params.seed is None else params.seed + index
    # a copy sharing the parent's (already checked) fields: `replace` would rebuild and re-check each child's
    # allowed_token_ids / bad-word tuples (128 children of 512k allowed ids: 8 s of the caller's thread)
    child = copy.copy(params)
    object.__setattr__(child, "n", 1)
    object.__setattr__(child, "seed", seed)
    return child


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto", seed: int = 0,
                 lora_modules: dict[str, str] | None = None, block_size: int = 16, num_kv_blocks: int | None = None,
                 kv_cache_memory: int | None = None, gpu_memory_utilization: float = 0.9,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, max_step_ms: float | None = 0.0,
                 enable_prefix_caching: bool = True, max_loras: int = 8,
                 max_cpu_loras: int = 64, max_lora_rank: int = 64, load_format: str = "auto",
                 scheduling_policy: str = "fcfs", enforce_eager: bool = False,
                 async_scheduling: bool | None = None, lora_dirs: Sequence[str] = (), tensor_parallel_size: int = 1,
                 warmup: bool = True, quantization: str | None = None,
                 speculative_config: dict[str, Any] | str | None = None, tokenizer: str | None = None,
                 revision: str | None = None, download_dir: str | None = None, trust_remote_code: bool = False,
                 enable_lora: bool = True) -> None:
        """vLLM's flat keyword arguments, mapped onto the nested `EngineConfig`. `warmup=False` skips the start-up
        kernel warm-up (`LLMEngine.warmup`): the first steps then compile Triton kernels as they meet them.
        `speculative_config`: vLLM's dict (`core/spec/config.py`). `max_step_ms`: the step-time budget while requests
        decode (None: auto, 0: off; `core/scheduling/step_budget.py`). Off by default here, unlike the server's auto:
        `generate` returns when every output is done, so no one waits on a gap between two tokens, and the budget's
        smaller chunks cost throughput (11% on issue 38's workload; docs/scheduling.md). `tokenizer`, `revision`,
        `download_dir`, `trust_remote_code`: as vLLM's (and the CLI's); `enable_lora`: accepted as vLLM spells it,
        adapters are always on."""
        config = EngineConfig(
            model=str(model or DEMO_MODEL_DIR), dtype=dtype, device=device, seed=seed,
            cache=CacheConfig(block_size=block_size, num_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory,
                              gpu_memory_utilization=gpu_memory_utilization,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len, policy=scheduling_policy,
                                      max_step_ms=max_step_ms),
            lora=LoRAConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=max_lora_rank,
                            lora_modules=tuple((lora_modules or {}).items()),
                            lora_dirs=tuple(str(d) for d in lora_dirs)),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
            speculative=SpeculativeConfig.parse(speculative_config),
            quantization=QuantizationConfig(method=quantization),
            load_format=load_format, enforce_eager=enforce_eager, async_scheduling=async_scheduling,
            tokenizer=tokenizer, revision=revision, download_dir=download_dir, trust_remote_code=trust_remote_code)
        engine = LLMEngine(config)
        if warmup:
            try:
                engine.warmup()
            except BaseException:
                engine.shutdown(graceful=False)   # its threads and workers go with the failed constructor
                raise
        self.engine = engine
        # `del llm` (the last reference) or the interpreter's exit releases the engine as `shutdown()` does
        # (vLLM's LLM does too): its compile worker processes and loader threads do not outlive the object. So
        # `llm.engine` lives as long as `llm`: `LLM(...).engine` alone is an engine already shut down
        self._finalizer = weakref.finalize(self, engine.shutdown)
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        return None, list(prompt)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora: str | None | Sequence[str | None] = None,
                 response_format: dict[str, Any] | None | Sequence[dict[str, Any] | None] = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. `use_tqdm`: accepted as vLLM spells it (no progress bar is drawn).
        `priority`: one per prompt, as vLLM's (lower first; needs `scheduling_policy="priority"`)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        num = len(prompts)
        params = self._per_prompt(sampling_params or SamplingParams(), num, "sampling_params")
        loras = self._per_prompt(lora, num, "lora")
        formats = self._per_prompt(response_format, num, "response_format")
        # any integer type (a NumPy one too) as an int; a float or a string is a TypeError here
        priorities = [0] * num if priority is None else [operator.index(p) for p in
                                                          self._per_prompt(list(priority), num, "priority")]
        entries = [self.engine.resolve_lora(name) for name in loras]
        compiled = [self._compile(f) for f in formats]

        engine = self.engine
        # bad_words tokenized once per SamplingParams given, not once per prompt and choice (the engine would)
        resolved: dict[int, SamplingParams] = {}
        for p in params:
            if id(p) not in resolved:
                resolved[id(p)] = resolve_bad_words(p, self.tokenizer)
        params = [resolved[id(p)] for p in params]
        results: list[RequestOutput] = []
        children: dict[str, tuple[int, int]] = {}
        try:
            for i, (prompt, p, entry, grammar, rank) in enumerate(zip(prompts, params, entries, compiled, priorities)):
                text, ids = self._encode(prompt)
                if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:   # vLLM's prompt-dict key
                    p = dataclasses.replace(p, cache_salt=prompt["cache_salt"])
                from_text = isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt)
                bos = getattr(self.tokenizer, "bos_token_id", None) if from_text else None   # a text's BOS stays
                ids = truncate_prompt(ids, p, engine.max_model_len, bos)   # vLLM's truncate_prompt_tokens
                results.append(RequestOutput(request_id=str(next(self._ids)), prompt=text, prompt_token_ids=ids,
                                             outputs=[], finished=False))
                for j in range(p.n):
                    rid = f"{results[-1].request_id}-{j}"
                    matcher = None if grammar is None else GrammarMatcher(grammar, stop_token_ids=p.stop_token_ids)
                    engine.add_request(rid, ids, child_params(p, j), lora=entry, grammar=matcher, priority=rank)
                    children[rid] = (i, j)
                    results[-1].outputs.append(CompletionOutput(index=j, text="", token_ids=[], finish_reason=None,
                                                                logprobs=[] if p.logprobs is not None else None))
        except BaseException:   # one prompt rejected at admission (RequestRejected): none of them runs
            for rid in children:
                engine.abort_request(rid)
            raise
        errors: list[str] = []
        try:
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    if delta.error is not None:
                        errors.append(f"request {delta.request_id}: {delta.error}")
                    i, j = children[delta.request_id]
                    out = results[i].outputs[j]
                    out.text += delta.new_text
                    out.token_ids.extend(delta.new_token_ids)
                    if out.logprobs is not None:
                        out.logprobs.extend(delta.new_logprobs)
                    if delta.prompt_logprobs is not None:
                        results[i].prompt_logprobs = delta.prompt_logprobs
                    if delta.finished:
                        out.finish_reason, out.stop_reason = delta.finish_reason, delta.stop_reason
                        results[i].num_cached_tokens = delta.num_cached_tokens
        except BaseException:   # interrupted (Ctrl-C in a notebook) or the engine failed: none of them is left behind
            if not engine.closed:
                for rid in children:
                    with contextlib.suppress(Exception):   # the original error is the one to see
                        engine.abort_request(rid)
            raise
        for r in results:
            r.finished = True
        if errors:  # every request has ended (the engine is clean); report what failed
            raise RuntimeError("; ".join(errors))
        return results

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             lora: str | None | Sequence[str | None] = None,
             response_format: dict[str, Any] | None | Sequence[dict[str, Any] | None] = None, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of `{"role", "content"}` messages) or a list of them, each
        rendered with the tokenizer's chat template (the BOS added only where the template does not write it, as
        the server does), then `generate`d; one output per conversation, in order."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model has no chat template; use generate")
        extra: dict[str, Any] = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        if continue_final_message:
            extra["continue_final_message"] = True
        bos = getattr(self.tokenizer, "bos_token", None)
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(list(conversation), tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **extra)
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(
                text, add_special_tokens=not (bos and text.startswith(bos)))})
        return self.generate(prompts, sampling_params, lora, response_format)

    def get_tokenizer(self) -> Any:
        """The tokenizer (vLLM's name for it)."""
        return self.tokenizer

    def shutdown(self) -> None:
        """Frees what the engine holds (`LLMEngine.shutdown`): device memory, the adapter loader threads, the grammar
        compile workers and the tensor-parallel workers; a second `LLM` can then be built in this process.
        Idempotent; the object cannot generate afterwards. Dropping the last reference to the object (or the
        interpreter's exit) does the same."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def get_metrics(self) -> list[Metric]:
        """The engine's counters, gauges and latency histograms as vLLM's `LLM.get_metrics()` returns them
        (Counter / Gauge / Vector / Histogram objects with `.name`, `.labels`, `.value`, `.values` or `.count`,
        `.sum`, `.buckets`), named as `/metrics` names them."""
        return engine_metrics(self.engine)

    def _compile(self, response_format: dict[str, Any] | None) -> Any:
        """None for free text, else the compiled grammar (raises grammar.GrammarError if unsupported)."""
        spec = parse_response_format(response_format, self.engine.schema_options)
        return None if spec is None else self.engine.grammar_compiler.compile(spec)

    @staticmethod
    def _per_prompt(value: Any, num: int, name: str) -> list[Any]:
        if isinstance(value, (list, tuple)):
            if len(value) != num:
                raise ValueError(f"{name} has {len(value)} entries for {num} prompts")
            return list(value)
        return [value] * num
