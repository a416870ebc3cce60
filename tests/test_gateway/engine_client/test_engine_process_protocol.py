"""The engine-process wire format: deltas (plain and with log-probs / errors), inputs, grammar handles."""
from __future__ import annotations

import pickle

from adapters.errors import AdapterError
from core.engine_core.grammar_handles import (RemoteGrammar, RemoteMatcher, RemoteTriggered,
                                              RemoteTriggeredMatcher, to_wire)
from core.engine_core.protocol import (INPUT_DECODER, INPUT_ENCODER, OUTPUT_DECODER, OUTPUT_ENCODER, AddRequest,
                                       EngineInput, EngineOutput, decode_delta, dumps, encode_delta, loads)
from core.engine.outputs import RequestDelta
from core.sampling.params import SamplingParams


def roundtrip(d: RequestDelta) -> RequestDelta:
    wire = OUTPUT_ENCODER.encode(EngineOutput([encode_delta(d)]))
    return decode_delta(OUTPUT_DECODER.decode(wire).deltas[0])


def test_plain_delta_is_a_msgpack_array_without_pickles() -> None:
    d = RequestDelta("r-0", [5, 6], " ab", False, None, 10, 2, num_cached_tokens=3)
    assert encode_delta(d).rich is None
    assert roundtrip(d) == d


def test_rich_delta_keeps_logprobs_error_and_exception() -> None:
    d = RequestDelta("r-1", [7], "x", True, "stop", 4, 1, new_logprobs=[(7, -0.5, [(7, -0.5), (3, -1.0)])],
                     prompt_logprobs=[None, (2, -0.1, [])])
    assert roundtrip(d) == d
    err = RequestDelta("r-2", [], "", True, None, 0, 0, error="gone", exception=AdapterError("gone", status=404))
    back = roundtrip(err)
    assert back.error == "gone" and isinstance(back.exception, AdapterError) and back.exception.status == 404


def test_unpicklable_exception_keeps_its_message() -> None:
    class Local(Exception):   # a local class does not pickle
        pass

    back = roundtrip(RequestDelta("r-3", [], "", True, None, 0, 0, error="boom", exception=Local("boom")))
    assert back.error == "boom" and back.exception is None


def test_input_batch_roundtrip() -> None:
    params = SamplingParams(max_tokens=7, temperature=0.0, stop=("x",))
    msg = EngineInput([AddRequest("a", [1, 2, 3], dumps(params), dumps({"tenant": "t"}))], ["b"], [])
    back = INPUT_DECODER.decode(INPUT_ENCODER.encode(msg))
    assert back.aborts == ["b"] and back.adds[0].prompt_token_ids == [1, 2, 3]
    assert loads(back.adds[0].params) == params and loads(back.adds[0].kwargs) == {"tenant": "t"}


def test_grammar_handles_pickle() -> None:
    grammar = RemoteGrammar("spec", (2,), 512)
    matcher = grammar.new_matcher([2, 9])
    assert matcher == RemoteMatcher("spec", (2, 9)) and to_wire(matcher) is matcher
    assert pickle.loads(pickle.dumps(matcher)) == matcher
    auto = RemoteTriggeredMatcher(RemoteTriggered(RemoteTriggered("spec", b"<tool_call>"), b"</think>", 7, True), (2,))
    assert pickle.loads(pickle.dumps(auto)) == auto


def test_reasoning_gate_over_auto_tools_crosses_whole() -> None:
    """`--reasoning-parser` over `tool_choice: "auto"` over a remote call grammar: the wire form keeps both
    triggers, the end tag's id and which gate is the reasoning one."""
    from grammar.matching.triggered import AutoToolGrammar, ReasoningGrammar
    from grammar.matching.triggered import FreeTextMasks

    calls = RemoteGrammar("calls-spec", (2,), 64)
    free = FreeTextMasks([b"a"] * 64, 64, b"<")
    gated = ReasoningGrammar(AutoToolGrammar(calls, b"<tool_call>", free), b"</think>", free, 9)
    wire = to_wire(gated.new_matcher([2, 5]))
    assert wire == RemoteTriggeredMatcher(
        RemoteTriggered(RemoteTriggered("calls-spec", b"<tool_call>", None, False), b"</think>", 9, True), (2, 5))
