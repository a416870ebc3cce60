"""A stand-in `core.engine.interface.ServingEngine` for app tests: no model, no loop, fixed state.

Requests are admitted by `check_request` (pass one that raises to stop every request after tokenization) and
never run: `submit` fails the test. The grammar compiler fails the test if a request reaches it.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import pytest

from core.engine.interface import EngineFacts, WarmupProgress
from core.engine.outputs import RequestDelta
from core.engine_core.protocol import Stats
from core.sampling.params import SamplingParams
from grammar.schema.lowering import SchemaOptions

IDLE_STATS = Stats(num_running=0, num_waiting=0, kv_usage=0.0, block_size=16, num_blocks=64, num_prompt_tokens=0,
                   num_generation_tokens=0, num_prefix_queries_tokens=0, num_prefix_hit_tokens=0, num_preemptions=0,
                   num_kernel_compiles_after_warmup=0, running_adapters="", waiting_adapters="")


class NoAdapters:
    def lookup(self, name: str) -> None:
        return None

    def entries(self) -> list[Any]:
        return []

    def available(self) -> list[tuple[str, str]]:
        return []


class NoCompiler:
    def submit(self, spec: Any) -> Any:
        pytest.fail("the stand-in engine compiles no grammar")

    check = submit

    def warm_lowering(self) -> None:
        pass

    @property
    def vocab(self) -> Any:
        pytest.fail("the stand-in engine has no token vocabulary")


class FakeEngine:
    def __init__(self, tokenizer: Any, *, alive: bool = True, ready: bool | None = None, vocab_size: int = 100,
                 max_model_len: int = 64, stats: Stats | None = IDLE_STATS,
                 check_request: Callable[[int, SamplingParams], int] | None = None,
                 warmup_progress: WarmupProgress = WarmupProgress()) -> None:
        self.tokenizer = tokenizer
        self.alive = alive
        self.warmed_up = alive if ready is None else ready
        self.ready = self.alive and self.warmed_up
        self.error: BaseException | None = None if alive else RuntimeError("the engine stopped")
        self.warmup_progress = warmup_progress
        self.num_in_flight = 0
        self.on_dead: list[Callable[[BaseException], None]] = []
        self.facts = EngineFacts(model_dir=Path("/models/base"), device="cpu", vocab_size=vocab_size,
                                 max_model_len=max_model_len, eos_token_ids=(2,), block_size=16, num_kv_blocks=64,
                                 schema_options=SchemaOptions.for_vocab_size(vocab_size))
        self.grammar_compiler = NoCompiler()
        self.adapters = NoAdapters()
        self._stats = stats
        self._check = check_request or self.facts.check_request
        self.num_refreshes = 0

    def fail(self, reason: str) -> None:
        self.alive = self.ready = False
        self.error = RuntimeError(reason)

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        return self._check(num_prompt_tokens, params)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, lora: Any = None,
               grammar: Any = None, tenant: str | None = None, priority: int = 0) -> "asyncio.Queue[RequestDelta]":
        pytest.fail("the stand-in engine runs no request")

    def abort(self, request_id: str) -> None:
        pass

    def stream(self, request_id: str, queue: "asyncio.Queue[RequestDelta]") -> AsyncIterator[RequestDelta]:
        pytest.fail("the stand-in engine runs no request")

    def cut_all(self, message: str) -> int:
        return 0

    def load_lora(self, name: str, path: str, replace: bool = False) -> Any:
        pytest.fail("the stand-in engine loads no adapter")

    def unload_lora(self, name: str) -> None:
        pytest.fail("the stand-in engine loads no adapter")

    def stats(self) -> Stats | None:
        return self._stats

    async def refresh(self) -> None:
        self.num_refreshes += 1

    def shutdown(self) -> None:
        pass
