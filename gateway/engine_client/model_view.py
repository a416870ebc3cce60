"""What the routes read from "the engine" when it runs in its own process: the model's files (tokenizer,
config, context length) resolved here without loading weights, the engine-reported pool size and stats, a
local admission check, and a grammar compiler whose compiles run in the engine process."""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable

from core.scheduling.admission import check_request
from core.config import EngineConfig
from core.engine_core.grammar_handles import RemoteGrammar
from core.engine_core.protocol import Stats
from core.engine.grammar_compilers import compile_limits
from core.engine.setup import load_eos_ids, resolve_model_files
from core.sampling.params import SamplingParams
from gateway.engine_client.registry_mirror import RemoteRegistry


@dataclass
class PoolView:
    num_blocks: int = 0
    block_size: int = 16


@dataclass
class PartsView:
    model_dir: Path


class RemoteCompiler:
    """`GrammarCompiler.submit` / `check` over the boundary: a `compile` / `check` command (the engine process's
    compiler lowers and compiles in its workers); the future holds a `RemoteGrammar` / None."""

    def __init__(self, command: Callable[[str, tuple[Any, ...]], "concurrent.futures.Future[Any]"],
                 tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._command = command
        self._tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, sorted(eos_token_ids)
        self._vocab: Any = None
        self._warmed = False

    def submit(self, spec: Any) -> "concurrent.futures.Future[Any]":
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def done(f: "concurrent.futures.Future[Any]") -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(RemoteGrammar(spec, self.eos_token_ids, self.vocab_size))

        self._command("compile", (spec,)).add_done_callback(done)
        return out

    def warm_lowering(self) -> None:
        """`GrammarCompiler.warm_lowering` in the engine process: a check of a trivial schema, sent once."""
        if not self._warmed:
            self._warmed = True
            from grammar.compile.lowering import SchemaRecipe
            from grammar.schema.lowering import SchemaOptions
            from grammar.specs.spec import recipe_spec

            self.check(recipe_spec("json_schema", SchemaRecipe.of({"type": "integer"}, SchemaOptions())))

    def check(self, spec: Any) -> "concurrent.futures.Future[Any]":
        if spec.recipe is None:
            out: concurrent.futures.Future[Any] = concurrent.futures.Future()
            out.set_result(None)
            return out
        return self._command("check", (spec,))

    @property
    def vocab(self) -> Any:
        """The token vocabulary (token bytes; `tool_choice: "auto"` builds its free-text masks over it here)."""
        if self._vocab is None:
            from grammar.compile.vocab import build_token_vocab

            self._vocab = build_token_vocab(self._tokenizer, self.vocab_size, self.eos_token_ids)
        return self._vocab


class EngineView:
    """The attributes of `LLMEngine` the gateway reads, for an engine in another process."""

    def __init__(self, config: EngineConfig, command: Callable[[str, tuple[Any, ...]], Any]) -> None:
        files = resolve_model_files(config)
        self.config = config
        self.tokenizer, self.model_config = files.tokenizer, files.cfg
        self.max_model_len, self.device = files.max_model_len, files.device
        self.parts = PartsView(files.model_dir)
        self.eos_token_ids = load_eos_ids(files.model_dir, files.tokenizer)
        self.block_size = config.cache.block_size
        self.kv = PoolView(0, self.block_size)       # num_blocks: from the engine's `info` event
        self.registry = RemoteRegistry(command, config.lora.lora_dirs)   # a mirror of the engine's adapters
        self.lora_pool = None
        self.tp = None                                # tensor-parallel workers are the engine process's children
        self.stats_snapshot: Stats | None = None
        self.refresh: Callable[[], Awaitable[None]] | None = None   # EngineClient.refresh: fresh stats now
        self.ready = False
        self.grammar_compiler = RemoteCompiler(command, self.tokenizer, self.model_config.vocab_size,
                                               self.eos_token_ids)
        self._schema_options: Any = None

    @property
    def schema_options(self) -> Any:
        """The same lowering options the engine process's compiler lowers with (grammar/compile/limits.py)."""
        if self._schema_options is None:
            self._schema_options = compile_limits().schema_options(self.model_config.vocab_size)
        return self._schema_options

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        return check_request(num_prompt_tokens, params, self.max_model_len, self.model_config.vocab_size,
                             self.block_size, self.kv.num_blocks)

    def load_lora(self, name: str, path: str) -> Any:
        return self.registry.load(name, path)

    def unload_lora(self, name: str) -> None:
        self.registry.unload(name)


async def refresh_engine_state(engine: Any) -> None:
    """Before a reader of engine state (/metrics, model and adapter listings) answers: an engine in its own
    process reports its stats and adapters as they are now, so a response the client has already seen is
    counted. In-process the state is read directly: nothing to do."""
    if isinstance(engine, EngineView) and engine.refresh is not None:
        await engine.refresh()
