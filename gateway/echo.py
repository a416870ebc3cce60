"""Completions `echo`: the prompt's text before each choice's text, and with `logprobs` the prompt tokens'
log-probabilities before the generated ones (the first prompt token's is null, as OpenAI and vLLM answer)."""
from __future__ import annotations

from typing import Any

from core.outputs import TokenLogprob
from gateway import tokenize_pool
from gateway.generation import Child, ChoiceResult
from gateway.protocol import CompletionRequest


async def echo_texts(tokenizer: Any, body: CompletionRequest, prompts: list[list[int]]) -> list[str] | None:
    """The prompt text of each prompt (a string prompt as sent, token ids decoded on a tokenizer thread);
    None without echo."""
    if not body.echo:
        return None
    if isinstance(body.prompt, str):
        return [body.prompt]
    if body.prompt and isinstance(body.prompt[0], str):
        return list(body.prompt)  # type: ignore[arg-type]
    return await tokenize_pool.run(lambda: [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts])


def prompt_entries(child: Child, engine_entries: list[TokenLogprob | None] | None) -> list[Any]:
    """The engine's per-position prompt logprobs, with the first token's as (id, None, [])."""
    if engine_entries is None:
        return []
    first = (child.prompt_token_ids[0], None, [])
    return [first] + [e for e in engine_entries[1:]]


def apply_echo(results: list[ChoiceResult], children: list[Child], texts: list[str]) -> None:
    """Non-streaming answers: the prompt text (and prompt logprobs) before each choice's own."""
    by_index = {c.index: c for c in children}
    for r in results:
        child = by_index[r.index]
        r.text = texts[child.prompt_index] + r.text
        r.logprobs = prompt_entries(child, r.prompt_logprobs) + r.logprobs
