"""The per-step host cost of bad_words and the lifetime of allowed_token_ids masks: a request with the most
bad_words a request may carry (2 x 128 sequences of ~500 tokens) costs no Python loop over its words' tokens
per step, its ids are bounds-checked once (not every step), and an allowed-ids mask never outlives its slot."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from core.sampling import penalties as penalties_mod
from core.sampling.bad_words import banned_by_bad_words
from core.sampling.params import SamplingParams
from core.sampling.penalties import PenaltyState


class Counted(tuple):
    """A token sequence that counts the single tokens read from it one by one."""
    reads = 0

    def __getitem__(self, i):   # type: ignore[override]
        if isinstance(i, int):
            Counted.reads += 1
        return super().__getitem__(i)


def naive(output: list[int], sequences) -> set[int]:
    return {s[-1] for s in sequences if len(s) == 1 or output[-(len(s) - 1):] == list(s[:-1])}


def test_matching_prefixes_cost_no_token_by_token_loop() -> None:
    # an output built to match every word but its last token: the old matcher read 511 tokens of each word
    seqs = [Counted([5] * 511 + [7 + i]) for i in range(256)]
    Counted.reads = 0
    assert banned_by_bad_words([5] * 2000, seqs) == {7 + i for i in range(256)}
    assert Counted.reads <= 3 * len(seqs)


def test_matches_a_naive_reference() -> None:
    rng = random.Random(0)
    for _ in range(300):
        seqs = tuple(tuple(rng.randrange(4) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 6)))
        output = [rng.randrange(4) for _ in range(rng.randint(0, 6))]
        assert banned_by_bad_words(output, seqs) == naive(output, seqs), (output, seqs)


def _req(rid: str, params: SamplingParams, out: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=[1, 2], output_token_ids=out, sampling_params=params,
                           num_output_tokens=len(out), status=SimpleNamespace(finished=False), eos_token_ids=())


def test_bad_word_ids_are_checked_once_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = penalties_mod.check_ids
    monkeypatch.setattr(penalties_mod, "check_ids", lambda ids, v, param: (calls.append(param), real(ids, v, param)))
    state = PenaltyState(32, torch.device("cpu"))
    params = SamplingParams(bad_words_token_ids=((3, 4), (5,)))
    out: list[int] = []
    for step in range(6):
        req = _req("a", params, out)
        batch = state.prepare([req])
        assert batch is not None
        tokens = state.apply(torch.zeros(1, 32), batch).argmax(-1)
        state.record(batch, tokens)
        out.append(3)
    assert calls.count("bad_words") == 1
    state.release("a")
    state.check_integrity()


def test_an_out_of_vocabulary_bad_word_fails_before_its_ban_is_used() -> None:
    state = PenaltyState(32, torch.device("cpu"))
    with pytest.raises(Exception) as err:
        state.prepare([_req("a", SamplingParams(bad_words_token_ids=((40,),)), [])])
    assert "bad_words" in str(err.value)


def test_an_allowed_mask_is_not_kept_when_taking_the_slot_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    state = PenaltyState(32, torch.device("cpu"), initial_slots=1)   # only the neutral row: the next take grows

    def no_memory(num_slots: int) -> None:
        raise torch.cuda.OutOfMemoryError("out of memory")

    monkeypatch.setattr(state, "_grow", no_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        state.prepare([_req("a", SamplingParams(allowed_token_ids=[1, 2]), [])])
    state.release("a")   # the request fails: its slot (none) and anything kept for it are released
    state.check_integrity()


def test_choices_share_their_parents_filters() -> None:
    from core.engine.llm import child_params   # noqa: PLC0415

    parent = SamplingParams(n=128, seed=7, allowed_token_ids=list(range(1 << 16)), bad_words_token_ids=((3, 4),))
    children = [child_params(parent, i) for i in range(parent.n)]
    assert [c.seed for c in children] == [7 + i for i in range(128)] and {c.n for c in children} == {1}
    # no choice rebuilds (and re-checks) the parent's id tuples: 128 x 512k ids took 8 s of the event loop
    assert all(c.allowed_token_ids is parent.allowed_token_ids for c in children)
    assert all(c.bad_words_token_ids is parent.bad_words_token_ids for c in children)
