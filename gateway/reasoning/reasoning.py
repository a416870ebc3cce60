"""`--reasoning-parser qwen3|deepseek_r1`: the `<think>...</think>` part of a chat output -> `reasoning_content`.

Where a request starts (`start_state`, from the prompt's last think tag, as vLLM's `is_reasoning_end` reads it):
  deepseek_r1  reasoning (the template may have opened `<think>`; output without a start tag is reasoning until
               `</think>`), unless the prompt's last tag is `</think>` (the template closed an empty block).
  qwen3        reasoning when the prompt's last tag is `<think>` (the template opened it); otherwise content
               until the output writes `<think>` (`enable_thinking: false` closes the block: no reasoning).
               A constrained request whose prompt did not close the reasoning (no `</think>` after the prompt's
               last `<think>`) is gated as vLLM's qwen3 parser gates it: free text until `</think>`, then the
               constraint; it then starts in reasoning (what precedes `</think>` is reasoning, with or without a
               leading `<think>`): gateway/reasoning/reasoning_output.py.
`ReasoningSplitter` walks the output delta by delta: text before the end tag is reasoning, after it content; a
tag split across deltas is held back until it is decided. The tags may be plain text (several tokens) or one
added token; a special token that the detokenizer skips is found by its id in the delta's token ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:   # the CLI's --help path imports this module and must not import torch
    from core.engine.interface import Tokenizer

REASONING_PARSERS = ("deepseek_r1", "qwen3")
REASONING, CONTENT, MAYBE = "reasoning", "content", "maybe"
Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class ReasoningTags:
    parser: str
    start: str = "<think>"
    end: str = "</think>"
    start_id: int | None = None      # the tag's id when it is one token of the vocabulary
    end_id: int | None = None
    skipped_ids: frozenset[int] = frozenset()   # tag ids the detokenizer drops (special tokens)


def reasoning_tags(parser: str, tokenizer: Tokenizer) -> ReasoningTags:
    """The parser's tags with their single-token ids (if the vocabulary has them) for `tokenizer`."""
    assert parser in REASONING_PARSERS, parser
    vocab = tokenizer.get_vocab()
    start_id, end_id = vocab.get("<think>"), vocab.get("</think>")
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            special.add(token_id)
    skipped = frozenset(i for i in (start_id, end_id) if i is not None and i in special)
    return ReasoningTags(parser, start_id=start_id, end_id=end_id, skipped_ids=skipped)


def last_prompt_tag(tags: ReasoningTags, prompt_ids: list[int], decode: Decode) -> str | None:
    """"start" or "end": the prompt's last think tag (None without one)."""
    if tags.start_id is not None and tags.end_id is not None:
        for token_id in reversed(prompt_ids):
            if token_id in (tags.start_id, tags.end_id):
                return "start" if token_id == tags.start_id else "end"
        return None
    text = decode(prompt_ids[-256:])   # plain-text tags: the prompt's tail as text
    at_start, at_end = text.rfind(tags.start), text.rfind(tags.end)
    return None if at_start == at_end == -1 else "start" if at_start > at_end else "end"


def state_after(tags: ReasoningTags, last: str | None) -> str:
    """REASONING, CONTENT or MAYBE (qwen3: content until the output opens `<think>`) after the prompt's last tag."""
    if last == "start":
        return REASONING
    if tags.parser == "deepseek_r1":
        return CONTENT if last == "end" else REASONING
    return MAYBE


def start_state(tags: ReasoningTags, prompt_ids: list[int], decode: Decode) -> str:
    """REASONING, CONTENT or MAYBE for a prompt."""
    return state_after(tags, last_prompt_tag(tags, prompt_ids, decode))


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for k in range(min(len(text), len(tag) - 1), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class ReasoningSplitter:
    """One choice's output -> (reasoning, content) pieces; counts the tokens spent reasoning."""

    def __init__(self, tags: ReasoningTags, state: str, decode: Decode, skip_special: bool = True) -> None:
        self.tags = tags
        self.state = state
        self.decode = decode
        self.skipped = tags.skipped_ids if skip_special else frozenset()
        self.held = ""                  # text that may be the beginning of a tag
        self.held_tokens = 0            # the tokens that wrote it
        self.num_reasoning_tokens = 0

    def _wanted(self) -> tuple[str, int | None]:
        return (self.tags.start, self.tags.start_id) if self.state == MAYBE else (self.tags.end, self.tags.end_id)

    def feed(self, text: str, token_ids: list[int]) -> tuple[str, str]:
        """The delta's (reasoning, content) text, whatever of it is decided."""
        if self.state == CONTENT:
            return "", text
        tag, tag_id = self._wanted()
        buf, num_held = self.held + text, len(self.held)
        self.held = ""
        if tag_id is not None and tag_id in self.skipped and tag_id in token_ids:
            k = token_ids.index(tag_id)     # a skipped special token: no text, found by its id
            at = num_held + (len(self.decode(token_ids[:k])) if k else 0)
            before = self._emit(buf[:at], final=True)
            self.num_reasoning_tokens += k + 1 if self.state == REASONING else 1
            rest, rest_ids = buf[at:], token_ids[k + 1:]
        else:
            at = buf.find(tag)
            if at < 0:
                if self.state == REASONING:
                    self.num_reasoning_tokens += len(token_ids)
                out = self._emit(buf, final=False)
                # tokens that wrote the held text (a start tag's beginning counts as reasoning once complete)
                continued = len(self.held) > len(text)   # the held text began in an earlier delta
                self.held_tokens = 0 if not self.held else \
                    self.held_tokens + len(token_ids) if continued else min(len(token_ids), 1)
                return out
            before = self._emit(buf[:at], final=True)
            k = self._token_at(token_ids, at + len(tag) - num_held)   # the delta's tokens that complete the tag
            if self.state == REASONING:
                self.num_reasoning_tokens += k
            elif at < num_held:   # the start tag began in held text
                self.num_reasoning_tokens += self.held_tokens + k
            else:
                self.num_reasoning_tokens += k - (self._token_at(token_ids, at + 1 - num_held) - 1)
            rest, rest_ids = buf[at + len(tag):], token_ids[k:]
        self.held_tokens = 0
        self.state = REASONING if self.state == MAYBE else CONTENT
        after = self.feed(rest, rest_ids)
        return before[0] + after[0], before[1] + after[1]

    def _token_at(self, token_ids: list[int], end: int) -> int:
        """How many of the delta's tokens it takes to write its first `end` characters (at least 1)."""
        if len(token_ids) <= 1 or end <= 0:
            return min(len(token_ids), 1)
        lo, hi = 1, len(token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.decode(token_ids[:mid])) >= end:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _emit(self, text: str, final: bool) -> tuple[str, str]:
        """Text in the current state; unless `final`, a possible partial tag at its end is held back."""
        if self.state == REASONING:
            # a start tag inside the reasoning (the model repeating the template's `<think>`) is dropped
            keep = 0 if final else _partial_suffix(text, (self.tags.start, self.tags.end))
            self.held = text[len(text) - keep:] if keep else ""
            body = text[:len(text) - keep].replace(self.tags.start, "")
            return body, ""
        keep = 0 if final else _partial_suffix(text, (self.tags.start,))
        self.held = text[len(text) - keep:] if keep else ""
        return "", text[:len(text) - keep]

    def finish(self) -> tuple[str, str]:
        """At the end of the output: what was held back, in the state it was in."""
        held, self.held = self.held, ""
        if not held:
            return "", ""
        return (held, "") if self.state == REASONING else ("", held)


def split_output(splitter: ReasoningSplitter, text: str, token_ids: list[int]) -> tuple[str | None, str | None]:
    """A whole (non-streamed) output -> (reasoning_content, content), None where empty (as vLLM answers)."""
    r1, c1 = splitter.feed(text, token_ids)
    r2, c2 = splitter.finish()
    return (r1 + r2) or None, (c1 + c2) or None


def delta_reasoning(delta: Any) -> str:
    """The reasoning text of a streamed delta ("" without a reasoning parser: gateway/reasoning/reasoning_output.py)."""
    return getattr(delta, "reasoning", "")


def add_reasoning_usage(reasoning: Any, usage: dict[str, Any]) -> dict[str, Any]:
    """`usage` with completion_tokens_details.reasoning_tokens when the request has a reasoning parser."""
    return reasoning.add_usage(usage) if reasoning is not None else usage
