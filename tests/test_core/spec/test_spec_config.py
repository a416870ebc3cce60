"""`SpeculativeConfig` parsing (vLLM's JSON) and the n-gram proposer."""
from __future__ import annotations

import pytest

from core.spec import SpeculativeConfig, SpeculativeConfigError
from core.spec.ngram import propose_ngram


def test_parse_ngram_and_draft_model() -> None:
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                                  '"prompt_lookup_max": 5, "disable_by_batch_size": 8}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max,
            cfg.disable_by_batch_size) == ("ngram", 4, 2, 5, 8)
    assert cfg.enabled_for(7) and not cfg.enabled_for(8)
    d = SpeculativeConfig.parse({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2})
    assert d.model == "/m" and d.enabled_for(10**6)
    assert SpeculativeConfig.parse(None) is None
    # vLLM infers the method: a draft model's directory alone is draft_model; "[ngram]" is ngram
    inferred = SpeculativeConfig.parse('{"model": "/draft", "num_speculative_tokens": 3}')
    assert (inferred.method, inferred.model, inferred.num_speculative_tokens) == ("draft_model", "/draft", 3)
    assert SpeculativeConfig.parse({"method": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    assert SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 1,
                                    "prompt_lookup_max": 2}).prompt_lookup_min == 1


@pytest.mark.parametrize("value,needle", [
    ("{", "not valid JSON"),
    ("[1]", "JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "'method'"),
    ({"method": "ngram"}, "'num_speculative_tokens' is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "'prompt_lookup_min'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "'disable_by_batch_size'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
])
def test_bad_configs_name_the_field(value: object, needle: str) -> None:
    with pytest.raises(SpeculativeConfigError, match=needle):
        SpeculativeConfig.parse(value)  # type: ignore[arg-type]


def test_ngram_longest_match_first_and_most_recent() -> None:
    # suffix [2, 3] recurs at 1 and 5; the longest suffix [9, 2, 3] only at 4 -> what followed it there
    ids = [1, 2, 3, 4, 9, 2, 3, 7, 8, 9, 2, 3]
    assert propose_ngram(ids, 3, 1, 3) == [7, 8, 9]
    assert propose_ngram(ids, 3, 1, 2) == [7, 8, 9]          # most recent occurrence of [2, 3]
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []          # nothing recurs
    assert propose_ngram([5, 6, 1, 5, 6], 2, 3, 3) == []       # below prompt_lookup_min... length 3 never recurs
    assert propose_ngram([5, 6, 1, 5, 6], 2, 2, 3) == [1, 5]
    assert propose_ngram([1, 2, 1, 2], 0, 1, 3) == []


def test_ngram_copy_reaching_the_end_continues_the_period() -> None:
    # [9, 205] last occurred 2 tokens back: the copy runs into the suffix and repeats the period
    assert propose_ngram([7, 9, 205, 9, 205], 5, 2, 2) == [9, 205, 9, 205, 9]
    assert propose_ngram([5, 5, 5, 5], 3, 1, 3) == [5, 5, 5]
