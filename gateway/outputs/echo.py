"""Completions `echo`: the prompt's text before each choice's text, and with `logprobs` the prompt tokens'
log-probabilities before the generated ones (the first prompt token's is null, as OpenAI and vLLM answer).
Also vLLM's `prompt_logprobs` (the same values, without echo): per choice on completions, once per answer on chat
(the rendered prompt's), a list with one entry per prompt token, null first, then
`{token_id: {"logprob", "rank", "decoded_token"}}` with the prompt token and the top-k."""
from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Sequence

from core.engine.interface import Tokenizer
from core.engine.outputs import RequestDelta, TokenLogprob
from gateway.inputs import tokenize_pool
from gateway.outputs.generation import Child, ChoiceResult
from gateway.protocol import CompletionRequest
from gateway.outputs.responses import TokenTexts, finite


async def echo_texts(tokenizer: Tokenizer, body: CompletionRequest, prompts: list[list[int]],
                     cut: Sequence[bool] = ()) -> list[str] | None:
    """The prompt text of each prompt (a string prompt as sent, token ids decoded on a tokenizer thread);
    None without echo. `cut`: per prompt, whether `truncate_prompt_tokens` cut it: a cut text prompt echoes the
    text of the tokens that ran (its kept BOS left out, as a text's), the text its prompt logprobs describe."""
    if not body.echo:
        return None
    texts: list[str | None] = [None] * len(prompts)   # ids: decoded
    if isinstance(body.prompt, str):
        texts = [body.prompt]
    elif body.prompt and isinstance(body.prompt[0], str):
        texts = list(body.prompt)  # type: ignore[arg-type]
    bos = getattr(tokenizer, "bos_token_id", None)

    def decode(i: int) -> str:
        ids = prompts[i]
        if texts[i] is not None and ids and ids[0] == bos:
            ids = ids[1:]
        return tokenizer.decode(ids, skip_special_tokens=False)

    todo = [i for i, t in enumerate(texts) if t is None or (i < len(cut) and cut[i])]
    if todo:
        done = await tokenize_pool.run(lambda: [decode(i) for i in todo])
        for i, text in zip(todo, done):
            texts[i] = text
    return texts  # type: ignore[return-value]


async def without_generation(deltas: AsyncIterator[tuple[int, RequestDelta]]
                             ) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Echo with max_tokens 0 (`CompletionRequest.echo_only`): each choice ran for one token, dropped here (its
    text, id and logprob): the answer is the prompt alone (and its logprobs), finish_reason "length", no
    completion tokens. Closing it closes `deltas` (which aborts the engine requests)."""
    try:
        async for index, d in deltas:
            yield index, dataclasses.replace(d, new_token_ids=[], new_text="", new_logprobs=[], num_output_tokens=0,
                                             finish_reason="length" if d.finished else None, stop_reason=None)
    finally:
        await deltas.aclose()  # type: ignore[attr-defined]


def prompt_entries(child: Child, engine_entries: list[TokenLogprob | None] | None) -> list[Any]:
    """The engine's per-position prompt logprobs, with the first token's as (id, None, [])."""
    if engine_entries is None:
        return []
    first = (child.prompt_token_ids[0], None, [])
    k = child.params.logprobs or 0   # the engine's top-k may be larger (a bigger prompt_logprobs)
    return [first] + [(e[0], e[1], e[2][:k]) for e in engine_entries[1:]]  # type: ignore[index]


def apply_echo(results: list[ChoiceResult], children: list[Child], texts: list[str]) -> None:
    """Non-streaming answers: the prompt text (and prompt logprobs) before each choice's own."""
    by_index = {c.index: c for c in children}
    for r in results:
        child = by_index[r.index]
        r.text = texts[child.prompt_index] + r.text
        r.logprobs = prompt_entries(child, r.prompt_logprobs) + r.logprobs


def vllm_prompt_logprobs(entries: list[TokenLogprob | None], k: int, texts: TokenTexts) -> list[Any]:
    """vLLM's shape of one prompt's logprobs: the prompt token (with its rank in the whole vocabulary) and
    the `k` most likely tokens at each position (ranks 1..k); entry 0 is null."""
    out: list[Any] = [None]
    for entry in entries[1:]:
        if entry is None:
            out.append(None)
            continue
        token_id, logprob, alternatives = entry
        position = {token_id: {"logprob": finite(logprob), "rank": getattr(entry, "rank", None),
                               "decoded_token": texts.text(token_id)}}
        for rank, (alt, alt_logprob) in enumerate(alternatives[:k], start=1):
            position.setdefault(alt, {"logprob": finite(alt_logprob), "rank": rank,
                                      "decoded_token": texts.text(alt)})
        out.append(position)
    return out


def add_prompt_logprobs(answer: dict[str, Any], results: list[ChoiceResult], k: int, texts: TokenTexts) -> None:
    """Sets `prompt_logprobs` on every choice of a non-streaming completions answer."""
    for choice, r in zip(answer["choices"], results):
        choice["prompt_logprobs"] = vllm_prompt_logprobs(r.prompt_logprobs or [None] * r.num_prompt_tokens, k,
                                                         texts)


def add_chat_prompt_logprobs(answer: dict[str, Any], results: list[ChoiceResult], k: int, texts: TokenTexts) -> None:
    """Sets the top-level `prompt_logprobs` of a non-streaming chat answer (vLLM's place): every choice shares
    the one rendered prompt."""
    first = results[0]
    answer["prompt_logprobs"] = vllm_prompt_logprobs(first.prompt_logprobs or [None] * first.num_prompt_tokens, k,
                                                     texts)
