"""Jump-forward over forced text (`core/spec/forced_text.py`, `core/spec/grammar_drafts.py`) on a real compiled
JSON-schema grammar of the demo model's tokenizer: the forced text of a state that allows several tokens, the
tokenizer's encoding as the proposal, the target's remembered tokenization, drafts cut by the grammar, a mask
per draft position; and end to end, outputs equal to no speculation (greedy and seeded) that validate."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from core import LLM, SamplingParams
from core.spec.forced_text import JumpForward
from core.spec.grammar_drafts import grammar_drafts, matchers_along
from grammar import parse_response_format
from grammar.matching.matcher import GrammarMatcher

SCHEMA = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "age": {"type": "integer"}, "tags": {"type": "array", "maxItems": 2,
                                                                          "items": {"type": "string", "maxLength": 6}}},
    "required": ["name", "age", "tags"], "additionalProperties": False}}}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
PROMPTS = ["# a person as JSON\n", "def person():\n    return ", "# settings\n"]


@pytest.fixture(scope="module")
def pair() -> tuple[LLM, LLM]:
    kw = dict(dtype="float32", device="cpu", num_kv_blocks=256, warmup=False)
    return LLM(**kw), LLM(**kw, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def grammar(pair: tuple[LLM, LLM]):
    eng = pair[0].engine
    return eng.grammar_compiler.compile(parse_response_format(SCHEMA, eng.schema_options))


def ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False)


def matcher_at(llm: LLM, grammar, text: str) -> GrammarMatcher:
    m = GrammarMatcher(grammar)
    for t in ids(llm, text):
        assert m.accept_token(t), text
    return m


def test_forced_text_of_states_that_allow_several_tokens(pair, grammar) -> None:
    plain, _ = pair
    jump = JumpForward(plain.tokenizer)
    key = matcher_at(plain, grammar, '{"').state
    assert grammar.state_info(key).num_allowed > 1          # no single forced token here...
    assert jump.forced_text(grammar, key) == b'name":'        # ...but forced text
    assert jump.forced_text(grammar, grammar.initial_state) == b"{"
    assert jump.forced_text(grammar, matcher_at(plain, grammar, '{"name": "ab').state) == b""   # free text
    assert jump.forced_text(grammar, matcher_at(plain, grammar, '{"name": "ab", ').state) == b'"age":'


def test_proposal_is_the_tokenizer_encoding_of_the_forced_text(pair, grammar) -> None:
    plain, _ = pair
    jump = JumpForward(plain.tokenizer)
    key = matcher_at(plain, grammar, '{"').state
    tokens, num_single, end = jump.propose(grammar, key, 8)
    assert tokens == ids(plain, 'name":') and num_single == 0
    assert end == matcher_at(plain, grammar, '{"name":').state
    assert jump.propose(grammar, key, 1)[0] == tokens[:1]
    # the quote of the next key is the only token allowed: counted as forced; the key after it is not
    comma = matcher_at(plain, grammar, '{"name": "ab", ').state
    tokens, num_single, _ = jump.propose(grammar, comma, 8)
    assert plain.tokenizer.decode(tokens) == '"age":' and num_single == 1
    assert jump.propose(grammar, matcher_at(plain, grammar, '{"name": "ab').state, 8)[0] == []


def test_the_targets_tokenization_is_remembered_per_state(pair, grammar) -> None:
    plain, _ = pair
    jump = JumpForward(plain.tokenizer)
    key = matcher_at(plain, grammar, '{"').state
    chars = [ids(plain, c)[0] for c in 'name":']
    assert all(len(ids(plain, c)) == 1 for c in 'name":')
    jump.observe(grammar, key, chars)                        # the target spelled the key one byte at a time
    assert jump.propose(grammar, key, 8)[0] == chars
    assert jump.propose(grammar, key, 3)[0] == chars[:3]
    free = matcher_at(plain, grammar, '{"name": "').state
    jump.observe(grammar, free, ids(plain, "ab"))           # free text is never remembered
    assert jump.propose(grammar, free, 8)[0] == []
    jump.forget()
    assert jump.propose(grammar, key, 8)[0] == ids(plain, 'name":')


def test_one_guess_per_proposal_while_the_target_tokenizes_otherwise(pair, grammar) -> None:
    plain, _ = pair
    jump = JumpForward(plain.tokenizer)
    comma = matcher_at(plain, grammar, '{"name": "ab", ').state
    assert plain.tokenizer.decode(jump.propose(grammar, comma, 8)[0]) == '"age":'
    key = matcher_at(plain, grammar, '{"').state
    for _ in range(8):                                      # the target spells keys byte by byte
        jump.observe(grammar, key, [ids(plain, c)[0] for c in 'name":'])
    assert jump.agreement < 0.5
    # the quote (the only token allowed) and one encoder guess ("age"); '":' would be a second guess
    assert plain.tokenizer.decode(jump.propose(grammar, comma, 8)[0]) == '"age'
    jump.forget()
    assert jump.agreement == 1.0


def test_drafts_continue_after_the_jump_and_stop_at_a_forbidden_token(pair, grammar) -> None:
    plain, _ = pair
    jump = JumpForward(plain.tokenizer)
    seen = []

    def rest(jumped: list[int], n: int) -> list[int]:
        seen.append((list(jumped), n))
        return ids(plain, " 12") + ids(plain, "}")           # "}" is forbidden: "tags" is required
    m = matcher_at(plain, grammar, '{"name": "ab", ')
    drafts, num_forced = grammar_drafts(m, 16, rest, jump)
    assert plain.tokenizer.decode(drafts) == '"age": 12' and num_forced == 1
    assert seen == [(drafts[:3], 13)]
    assert m.state == matcher_at(plain, grammar, '{"name": "ab", ').state    # the request's grammar did not move
    assert grammar_drafts(object(), 4, rest, jump) == ([], 0)               # no state to draft from


def test_each_draft_position_gets_the_mask_of_its_state(pair, grammar) -> None:
    plain, _ = pair
    m = matcher_at(plain, grammar, '{"')
    drafts = ids(plain, 'name": "x')
    along = matchers_along(m, drafts)
    assert along is not None and len(along) == len(drafts) + 1 and along[0] is m
    words = (grammar.vocab_size + 31) // 32
    for j, fork in enumerate(along):
        want, got = torch.zeros((1, words), dtype=torch.int32), torch.zeros((1, words), dtype=torch.int32)
        matcher_at(plain, grammar, '{"' + plain.tokenizer.decode(drafts[:j])).fill_bitmask(want, 0)
        fork.fill_bitmask(got, 0)
        assert torch.equal(want, got), j
    assert m.state == matcher_at(plain, grammar, '{"').state


def check_same(plain: LLM, spec: LLM, params: SamplingParams) -> list:
    a = plain.generate(PROMPTS, params, response_format=SCHEMA)
    b = spec.generate(PROMPTS, params, response_format=SCHEMA)
    num_validated = 0
    for x, y in zip(a, b):
        for ox, oy in zip(x.outputs, y.outputs):
            assert oy.token_ids == ox.token_ids and oy.text == ox.text
            assert (ox.finish_reason, oy.finish_reason) in (("stop", "stop"), ("length", "length"))
            if ox.finish_reason == "stop":
                jsonschema.validate(json.loads(oy.text), SCHEMA["json_schema"]["schema"])
                num_validated += 1
    assert num_validated > 0, "no output ended with stop: nothing was validated"
    spec.engine.check_integrity()
    assert spec.engine.kv.usage() == 0.0
    return b


def test_greedy_schema_outputs_equal_no_speculation_and_validate(pair) -> None:
    plain, spec = pair
    stats = spec.engine.stats.spec
    params = SamplingParams(max_tokens=80, temperature=0.0)
    check_same(plain, spec, params)
    first = stats.num_accepted_tokens
    assert spec.engine.spec.decoder.jump.num_remembered > 0                         # the target's tokenizations
    check_same(plain, spec, params)                                         # again, with the memory
    assert stats.num_accepted_tokens - first > first > 0


def test_seeded_sampling_with_a_schema_is_token_for_token(pair) -> None:
    plain, spec = pair
    check_same(plain, spec, SamplingParams(max_tokens=80, temperature=0.9, top_p=0.95, seed=7, n=2))


def test_a_grammar_without_states_gets_no_drafts_and_runs(pair) -> None:
    """An xgrammar (EBNF) matcher exposes no state to draft from: its rows run without drafts (this crashed
    the step before), and the output equals the output without speculation."""
    from grammar.specs.constraints import grammar_spec
    from grammar.matching.matcher import make_matcher

    outs = []
    for llm in pair:
        eng = llm.engine
        compiled = eng.grammar_compiler.compile(grammar_spec('root ::= "ab" ("ab")* "c"', "grammar"))
        eng.add_request("cfg", llm.tokenizer.encode("ab ab ab ab"), SamplingParams(max_tokens=30, temperature=0.0),
                        grammar=make_matcher(compiled))
        out = []
        while eng.has_unfinished_requests():
            for d in eng.step():
                assert d.error is None
                out += d.new_token_ids
        outs.append(out)
    assert outs[0] == outs[1] and len(outs[0]) > 10


def test_schema_with_penalties_walks_each_position_and_stays_exact(pair) -> None:
    """Rows with penalties sample each position when the walk reaches it (their state depends on the tokens
    before): with a schema and jump-forward drafts they still equal no speculation."""
    plain, spec = pair
    before = spec.engine.stats.spec.num_accepted_tokens
    check_same(plain, spec, SamplingParams(max_tokens=80, temperature=0.0, presence_penalty=0.4,
                                           frequency_penalty=0.2))
    assert spec.engine.stats.spec.num_accepted_tokens > before
