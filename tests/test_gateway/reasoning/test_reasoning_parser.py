"""The reasoning parsers on token sequences: every split of the stream gives the whole-output answer, for both
parsers, with the think tags as plain text (several tokens), as added tokens and as skipped special tokens."""
from __future__ import annotations

from typing import Any

import pytest

from gateway.reasoning.reasoning import (CONTENT, MAYBE, REASONING, ReasoningSplitter, reasoning_tags, split_output,
                                         start_state)
from tiny_models import build_tokenizer

REASONING_TEXT = "Let me think: x = 1 < 2 and </th is not a tag."
ANSWER = '\n\n{"answer": 42}'


@pytest.fixture(scope="module", params=["plain", "added", "special"])
def tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    path = build_tokenizer(tmp_path_factory.mktemp(f"tok_{request.param}"))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if request.param == "added":
        tokenizer.add_tokens(["<think>", "</think>"])
    elif request.param == "special":
        tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tokenizer.kind = request.param
    return tokenizer


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _decode(tok: Any, ids: list[int]) -> str:
    return str(tok.decode(ids, skip_special_tokens=True))


def _deltas(tok: Any, ids: list[int], cuts: list[int]) -> list[tuple[str, list[int]]]:
    """The stream as the detokenizer sends it, cut before each token index in `cuts`."""
    bounds = [0, *cuts, len(ids)]
    return [(_decode(tok, ids[:b])[len(_decode(tok, ids[:a])):], ids[a:b]) for a, b in zip(bounds, bounds[1:])]


def _stream(tok: Any, state: str, deltas: list[tuple[str, list[int]]]) -> tuple[str, str, int]:
    splitter = ReasoningSplitter(reasoning_tags("deepseek_r1", tok), state, lambda ids: _decode(tok, ids))
    reasoning, content = "", ""
    for text, ids in deltas:
        r, c = splitter.feed(text, ids)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c, splitter.num_reasoning_tokens


def _whole(tok: Any, state: str, ids: list[int]) -> tuple[str | None, str | None, int]:
    splitter = ReasoningSplitter(reasoning_tags("qwen3", tok), state, lambda x: _decode(tok, x))
    reasoning, content = split_output(splitter, _decode(tok, ids), ids)
    return reasoning, content, splitter.num_reasoning_tokens


def _num_tokens_through_end(tok: Any, ids: list[int]) -> int:
    end_id = tok.get_vocab().get("</think>")
    if end_id is not None:
        return ids.index(end_id) + 1
    return next(k for k in range(len(ids) + 1) if "</think>" in tok.decode(ids[:k]))


@pytest.mark.parametrize("opened", [True, False])
def test_every_split_point_gives_the_whole_answer(tok: Any, opened: bool) -> None:
    """deepseek_r1 / an opened template: no start tag needed; qwen3 in MAYBE state: the output opens it."""
    text = ("" if opened else "<think>") + REASONING_TEXT + "</think>" + ANSWER
    ids = _ids(tok, text)
    state = REASONING if opened else MAYBE
    want_tokens = _num_tokens_through_end(tok, ids)
    assert _whole(tok, state, ids) == (REASONING_TEXT, ANSWER, want_tokens)
    assert _stream(tok, state, _deltas(tok, ids, list(range(1, len(ids))))) == (REASONING_TEXT, ANSWER, want_tokens)
    for cut in range(len(ids) + 1):
        reasoning, content, _ = _stream(tok, state, _deltas(tok, ids, [cut]))
        assert (reasoning, content) == (REASONING_TEXT, ANSWER), (tok.kind, cut)
    for a in range(1, len(ids)):   # and every pair of split points
        for b in range(a + 1, len(ids)):
            assert _stream(tok, state, _deltas(tok, ids, [a, b]))[:2] == (REASONING_TEXT, ANSWER), (tok.kind, a, b)


def test_an_unclosed_reasoning_stays_reasoning(tok: Any) -> None:
    """max_tokens inside the reasoning: everything is reasoning, content is None (streamed: no content)."""
    ids = _ids(tok, REASONING_TEXT + "</thi")
    whole = _decode(tok, ids)
    assert _whole(tok, REASONING, ids) == (whole, None, len(ids))
    for cut in range(len(ids) + 1):
        assert _stream(tok, REASONING, _deltas(tok, ids, [cut])) == (whole, "", len(ids))


def test_without_reasoning(tok: Any) -> None:
    """qwen3 whose output never opens <think>, or a prompt that closed the block: all content, 0 tokens."""
    ids = _ids(tok, "plain answer </think> x")
    whole = _decode(tok, ids)
    for state in (MAYBE, CONTENT):
        assert _whole(tok, state, ids) == (None, whole, 0)
        for cut in range(len(ids) + 1):
            assert _stream(tok, state, _deltas(tok, ids, [cut])) == ("", whole, 0)


def test_a_repeated_start_tag_is_dropped_from_the_reasoning(tok: Any) -> None:
    ids = _ids(tok, "<think>" + REASONING_TEXT + "</think>" + ANSWER)
    assert _whole(tok, REASONING, ids)[:2] == (REASONING_TEXT, ANSWER)


def test_start_state_reads_the_prompts_last_tag(tok: Any) -> None:
    decode = lambda ids: str(tok.decode(ids, skip_special_tokens=False))   # noqa: E731
    opened = _ids(tok, "<|user|>hi<|assistant|>\n<think>\n")
    closed = _ids(tok, "<|user|>hi<|assistant|>\n<think>\n\n</think>\n\n")
    neither = _ids(tok, "<|user|>hi<|assistant|>\n")
    r1, qwen3 = reasoning_tags("deepseek_r1", tok), reasoning_tags("qwen3", tok)
    assert [start_state(r1, p, decode) for p in (opened, closed, neither)] == [REASONING, CONTENT, REASONING]
    assert [start_state(qwen3, p, decode) for p in (opened, closed, neither)] == [REASONING, MAYBE, MAYBE]


def test_a_constraint_waits_for_the_end_tag_unless_the_prompt_closed_the_reasoning(tok: Any) -> None:
    """vLLM's rule for both parsers: the constraint is gated unless the prompt's last tag is `</think>`; Qwen3's
    thinking template opens no `<think>`, and the gated output's text before `</think>` is then reasoning, with
    or without a leading `<think>` (streamed at every split point alike)."""
    from gateway.reasoning.reasoning_output import ReasoningRequest

    opened = _ids(tok, "<|user|>hi<|assistant|>\n<think>\n")
    closed = _ids(tok, "<|user|>hi<|assistant|>\n<think>\n\n</think>\n\n")
    neither = _ids(tok, "<|user|>hi<|assistant|>\n")
    for parser in ("qwen3", "deepseek_r1"):
        tags = reasoning_tags(parser, tok)
        assert [ReasoningRequest(tags, p, tok, True).gates(True) for p in (opened, closed, neither)] == \
            [True, False, True]
        assert not any(ReasoningRequest(tags, p, tok, True).gates(False) for p in (opened, closed, neither))
    for text in (REASONING_TEXT, "<think>" + REASONING_TEXT):
        ids = _ids(tok, text + "</think>" + ANSWER)
        request = ReasoningRequest(reasoning_tags("qwen3", tok), neither, tok, True)
        assert request.gates(True) and request.state == REASONING
        assert split_output(request.splitter(0), _decode(tok, ids), ids) == (REASONING_TEXT, ANSWER)
        for cut in range(len(ids) + 1):
            assert _stream(tok, REASONING, _deltas(tok, ids, [cut]))[:2] == (REASONING_TEXT, ANSWER), (tok.kind, cut)


def test_tag_ids(tok: Any) -> None:
    tags = reasoning_tags("qwen3", tok)
    if tok.kind == "plain":
        assert tags.start_id is None and tags.end_id is None
    else:
        assert tags.end_id == tok.convert_tokens_to_ids("</think>")
        assert bool(tags.skipped_ids) == (tok.kind == "special")


def test_the_flag_and_an_unknown_parser(capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import build_parser, config_from_args

    parser = build_parser()
    for name in ("qwen3", "deepseek_r1"):
        config = config_from_args(parser.parse_args(["serve", "--reasoning-parser", name]), parser)
        assert config.reasoning_parser == name
    assert config_from_args(parser.parse_args(["serve"]), parser).reasoning_parser is None
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["serve", "--reasoning-parser", "granite"])
    assert info.value.code == 2
    assert "no reasoning parser 'granite'; loraplex has deepseek_r1, qwen3" in capsys.readouterr().err
