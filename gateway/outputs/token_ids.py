"""vLLM's `return_token_ids`: the token ids behind an answer, for trainers that must not re-tokenize text (RL
rollouts: verl, OpenRLHF, SkyRL).

Completions: each choice carries `prompt_token_ids` (its prompt's ids, as the engine ran them: after
`truncate_prompt_tokens`) and `token_ids` (the ids it generated). Chat: the answer carries the rendered prompt's
`prompt_token_ids` once, at the top level, and each choice its `token_ids`. Not asked, the fields are null on a
collected answer (vLLM's shape) and absent from stream chunks.

`token_ids` are every token the choice generated, as vLLM returns them: a stop token (EOS, `stop_token_ids`) that
ended it included, the tokens of a matched stop string included whatever `include_stop_str_in_output` says (the
text is cut, the ids are not), reasoning and tool-call tokens included (the text is split into
`reasoning_content` / `tool_calls`, the ids stay one list). `echo` does not add the prompt's ids to `token_ids`
(they are `prompt_token_ids`). Streamed, each chunk's `token_ids` are the ids new in it (every chunk of one choice,
joined, equal the collected list): a token whose text is held back (part of a character, a possible stop string)
still gets its chunk. `prompt_token_ids` come once per choice: on its first chunk (completions), on each choice's
first (role) chunk (chat)."""
from __future__ import annotations

from typing import Any

from gateway.outputs.generation import Child, ChoiceResult


def add_token_ids(answer: dict[str, Any], results: list[ChoiceResult], children: list[Child], chat: bool) -> None:
    """Fills the null `prompt_token_ids` / `token_ids` of a collected answer (completion_body / chat_body)."""
    prompts = {c.index: c.prompt_token_ids for c in children}
    for choice, r in zip(answer["choices"], results):
        choice["token_ids"] = list(r.token_ids)
        if not chat:
            choice["prompt_token_ids"] = list(prompts[r.index])
    if chat:
        answer["prompt_token_ids"] = list(children[0].prompt_token_ids)
