"""vLLM's detokenization fields in core/sampling/detokenizer.py: stop strings (cut from the text, also when they span
tokens), `include_stop_str_in_output` (the matched stop string ends the text; nothing is held back while
streaming) and `spaces_between_special_tokens=False` (adjacent added
tokens are joined without the space a decoder puts before each token)."""
from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from core.sampling.detokenizer import IncrementalDetokenizer
from core.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def wordpiece() -> Any:
    """A decoder that writes a space before every token: the case spaces_between_special_tokens is about."""
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2, "stop": 3, "here": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.add_special_tokens({"additional_special_tokens": ["<a>", "<b>"]})
    return fast


def run(tokenizer: Any, words: list[str], params: SamplingParams) -> tuple[str, list[str], bool]:
    """(final text, streamed deltas, stopped) of the tokens of `words`, fed one by one."""
    detok = IncrementalDetokenizer(tokenizer, [], params, use_prompt_context=False)
    deltas, stopped = [], False
    for token_id in tokenizer.convert_tokens_to_ids(words):
        stopped = detok.add_token(token_id)
        deltas.append(detok.take_delta(stopped))
        if stopped:
            break
    return detok.text, deltas, stopped


def test_stop_string_cut_or_kept(wordpiece: Any) -> None:
    words = ["hello", "world", "stop", "here", "hello"]
    cut, cut_deltas, stopped = run(wordpiece, words, SamplingParams(stop=("stop",)))
    assert stopped and cut == "hello world " and "".join(cut_deltas) == cut
    kept, kept_deltas, stopped = run(wordpiece, words, SamplingParams(stop=("stop",), include_stop_str_in_output=True))
    assert stopped and kept == "hello world stop" and "".join(kept_deltas) == kept
    # nothing is held back while streaming when the stop string is kept: every token's text goes out at once
    assert kept_deltas[:2] == ["hello", " world"] and cut_deltas[:2] == ["he", "llo wo"]
    # the earliest match wins; a stop inside the token that completes it ends the text right after it
    both, _, _ = run(wordpiece, words, SamplingParams(stop=("here", "world"), include_stop_str_in_output=True))
    assert both == "hello world"


def test_stop_string_across_tokens(wordpiece: Any) -> None:
    """A stop string that starts in one token's text and ends in a later one's is found (and cut there)."""
    words = ["hello", "world", "stop", "here", "hello"]
    cut, deltas, stopped = run(wordpiece, words, SamplingParams(stop=("ld st",)))
    assert stopped and cut == "hello wor" and "".join(deltas) == cut
    kept, _, stopped = run(wordpiece, words, SamplingParams(stop=("rld stop he",), include_stop_str_in_output=True))
    assert stopped and kept == "hello world stop he"


def test_spaces_between_special_tokens(wordpiece: Any) -> None:
    words = ["hello", "<a>", "<b>", "world"]
    spaced, _, _ = run(wordpiece, words, SamplingParams(skip_special_tokens=False))
    assert spaced == "hello <a> <b> world"
    joined, deltas, _ = run(wordpiece, words, SamplingParams(skip_special_tokens=False,
                                                             spaces_between_special_tokens=False))
    assert joined == "hello <a><b> world" and "".join(deltas) == joined
    skipped, _, _ = run(wordpiece, words, SamplingParams(spaces_between_special_tokens=False))
    assert skipped == run(wordpiece, words, SamplingParams())[0]   # special tokens hidden: no effect


def test_added_tokens_are_read_once_per_tokenizer(wordpiece: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The added-token table is built on the engine thread: once per tokenizer, not once per request (a tokenizer
    with thousands of added tokens, e.g. Gemma's, took ~30 ms a request, stalling every other request's step)."""
    reads = []
    table = type(wordpiece).added_tokens_decoder

    def counted(self: Any) -> Any:
        reads.append(1)
        return table.fget(self)

    monkeypatch.setattr(type(wordpiece), "added_tokens_decoder", property(counted))
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    for _ in range(5):
        assert run(wordpiece, ["hello", "<a>", "<b>", "world"], params)[0] == "hello <a><b> world"
    assert len(reads) <= 1, reads
    wordpiece.add_tokens(["<c>"], special_tokens=True)
    assert run(wordpiece, ["<a>", "<c>"], params)[0] == "<a><c>"   # a token added later is seen
