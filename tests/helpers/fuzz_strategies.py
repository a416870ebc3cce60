"""Hypothesis strategies for the request-body fuzz test (tests/test_gateway/api/test_fuzz_bodies.py).

Every field of every route has a targeted strategy of extreme values: token ids at and past both vocabulary
sizes (the tokenizer's 512 and the model's wider 544), huge and negative integers, floats at and past every
range's ends (NaN, infinities, subnormals), empty and over-long lists, wrong types and long strings; fields
a route does not know get generic JSON. `EXTREMES` is the deterministic sweep (every field x every listed
value, on a rich valid body), the strategies the random part.
"""
from __future__ import annotations

import json
import os
import random
from typing import Any

from hypothesis import strategies as st

def fuzz_seed() -> int:
    """`LORAPLEX_FUZZ_SEED` when set (replays a run), else a fresh seed per run: print it, and name it in failures."""
    env = os.environ.get("LORAPLEX_FUZZ_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**32)


TOKENIZER_VOCAB = 512   # tests/helpers/tiny_models.py's tokenizer
MODEL_VOCAB = 544       # the checkpoint's logits are wider (padded embeddings, as many real checkpoints)
IDS = [0, 1, TOKENIZER_VOCAB - 1, TOKENIZER_VOCAB, MODEL_VOCAB - 1, MODEL_VOCAB, MODEL_VOCAB + 1, 1000000000,
       2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, 10**30, -1, -(2**63), -(2**64)]
INTS = [0, 1, -1, 4, 5, 20, 21, 64, 65, 128, 129, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**400]
FLOATS = [0.0, -0.0, 5e-324, 1e-40, 1e-6, 0.5, 1.0000001, 2.0001, -2.0001, 100.0001, 1e308, float("inf"),
          float("-inf"), float("nan")]   # every range's ends, float32 underflow / overflow, NaN
HUGE_TEXT = "def f(x):\n    return x\n" * 2000            # 46 KB: far past --max-model-len
WRONG_TYPES = [None, True, "1", [], {}, [1], {"a": 1}, 1.5]

SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.sampled_from(["tiny", "json_schema", "json_object", "user", "system", "text", "\ud800", "\x00"]))
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4)
                    | st.dictionaries(st.text(max_size=6), kids, max_size=4), max_leaves=12)

ids = st.sampled_from(IDS) | st.integers(-3, MODEL_VOCAB + 3)
ints = st.sampled_from(INTS) | st.integers(-3, 70)
floats = st.sampled_from(FLOATS) | st.floats(-3, 3) | st.floats(allow_nan=True, allow_infinity=True)
bools = st.booleans() | st.sampled_from(WRONG_TYPES)
texts = st.text(max_size=20) | st.sampled_from(["", "\x00", "\ud800", "tiny", "x" * 5000, HUGE_TEXT])
id_lists = (st.lists(ids, max_size=6) | st.just([]) | st.just([TOKENIZER_VOCAB] * 65)
            | st.just(list(range(64))) | st.just([1] * 10_000) | st.just([MODEL_VOCAB] * 64))

EMPTY_LANGUAGE = [{"type": "string", "enum": []}, False, {"not": {}}, {"type": "integer", "minimum": 5, "maximum": 2},
                  {"allOf": [{"type": "string"}, {"type": "integer"}]}]


# -- exponential shapes (issue 31): a small text whose regex or automaton grows exponentially with its depth ----
def nested_schema(shape: str, depth: int, width: int, min_count: int) -> dict[str, Any]:
    """`depth` levels of `shape`, each writing the level below about `width` times (or branching `width` ways):
    arrays with small maxItems, free-form maps with small maxProperties, anyOf / oneOf branches through $refs,
    all-optional members (their orders multiply), tuples of the level below, and strings whose pattern is a bounded
    repetition of bounded repetitions."""
    if shape == "pattern":
        return {"type": "string", "pattern": nested_repetition(depth, width)}
    ref = "#/$defs/d{}"
    defs: dict[str, Any] = {"d0": {"type": "integer"}}
    for k in range(depth):
        below = {"$ref": ref.format(k)}
        if shape == "arrays":
            level: dict[str, Any] = {"type": "array", "items": below, "maxItems": width + 1}
            if min_count:
                level["minItems"] = min(min_count, width + 1)
        elif shape == "maps":
            level = {"type": "object", "additionalProperties": below, "maxProperties": width + 1}
        elif shape in ("anyOf", "oneOf"):
            level = {shape: [{"type": "array", "items": below, "minItems": 1, "maxItems": 1}]
                     + [{"type": "object", "properties": {f"k{i}": below}, "required": [f"k{i}"]}
                        for i in range(width)]}
        elif shape == "optional":
            level = {"type": "object", "properties": {f"p{i}": below for i in range(width + 2)}}
        else:
            assert shape == "tuple", shape
            level = {"type": "array", "prefixItems": [below] * (width + 1), "minItems": min_count}
        defs[f"d{k + 1}"] = level
    return {"$defs": defs, "$ref": ref.format(depth)}


def nested_repetition(depth: int, width: int) -> str:
    """((a{0,w}b){0,w}c){0,w}...: an automaton of ~w^depth states from a few dozen characters."""
    out = "a"
    for k in range(depth):
        out = f"(?:{out}{{0,{width + 1}}}{'bcdefghij'[k % 9]})"
    return out


SCHEMA_SHAPES = ("arrays", "maps", "anyOf", "oneOf", "optional", "tuple", "pattern")
EXPANDING_SCHEMAS = st.builds(nested_schema, st.sampled_from(SCHEMA_SHAPES), st.integers(6, 40),
                              st.integers(1, 3), st.integers(0, 2))
EXPANDING_REGEXES = (st.builds(nested_repetition, st.integers(2, 6), st.integers(2, 40))
                     | st.builds(lambda k: f"(a|b)*a(a|b){{{k}}}", st.integers(8, 30))
                     | st.builds(lambda k, w: f"(?:[a-z]{{0,{w}}}[0-9]){{0,{k}}}", st.integers(2, 60),
                                 st.integers(2, 60)))
SCHEMAS = st.sampled_from(EMPTY_LANGUAGE + [{}, True, {"type": "object"}, {"type": "string", "maxLength": 0},
                                            {"type": "array", "items": {"type": "integer"}, "maxItems": 10**9},
                                            {"type": "string", "pattern": "[^\\s\\S]"},
                                            {"type": "string", "minLength": 10**9},
                                            {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}]) | JSON
WHITESPACE = st.sampled_from(["[ ]?", "[ \\n]{0,4}", "[ ]*", "", "x", "(", "[^\\s\\S]", " {1000000}"]) | JSON
REGEXES = st.sampled_from(["[^\\s\\S]", "[b&&c]", "a{0}", "(a|b)*c", "a{1000000}", "\\x{10FFFF}", "", "(",
                           "(?=a)", "\u4e16", "x" * 20_000, "a*" * 2000]) | st.text(max_size=8)
GRAMMARS = st.sampled_from(['root ::= root "a"', 'root ::= a\na ::= "x" a', 'root ::= [^\\x00-\\U0010FFFF]',
                            'root ::= "a"', 'root ::= ""', "root ::=", 'root ::= "a"{1000000}', "x" * 70_000,
                            'root ::= b', "", "{"]) | st.text(max_size=12)
CHOICES = (st.lists(texts, max_size=4) | st.just([]) | st.just([""]) | st.just(["a"] * 1025)
           | st.just(["x" * 70_000]))
RESPONSE_FORMATS = st.fixed_dictionaries(
    {"type": st.sampled_from(["json_schema", "json_object", "text", "yaml"])},
    optional={"json_schema": st.fixed_dictionaries({"name": texts}, optional={"schema": SCHEMAS,
                                                                               "strict": bools})}) | JSON
STRUCTURED = st.fixed_dictionaries({}, optional={"choice": CHOICES, "regex": REGEXES, "json": SCHEMAS,
                                                 "grammar": GRAMMARS, "json_object": bools}) | JSON
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "bot", ""])},
    optional={"content": texts | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                                          max_size=3) | JSON,
              "name": texts, "tool_call_id": texts,
              "tool_calls": st.lists(st.fixed_dictionaries({"id": texts, "type": st.just("function"),
                                                            "function": st.fixed_dictionaries(
                                                                {"name": texts, "arguments": texts | JSON})}),
                                     max_size=2) | JSON})
MESSAGES = st.lists(MESSAGE, max_size=3) | st.just([{"role": "user", "content": HUGE_TEXT}])
FUNCTION = st.fixed_dictionaries({"name": st.sampled_from(["f", "", "x" * 300, "a b"]) | texts},
                                 optional={"parameters": SCHEMAS, "description": texts, "strict": bools})
TOOLS = (st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "x"]), "function": FUNCTION}),
                  max_size=3) | st.just([]) | JSON)
TOOL_CHOICE = (st.sampled_from(["auto", "none", "required", "any", ""])
               | st.fixed_dictionaries({"type": st.just("function"),
                                        "function": st.fixed_dictionaries({"name": texts})}) | JSON)
LOGIT_BIAS = (st.dictionaries(st.sampled_from([str(i) for i in IDS] + ["x", "", "1" * 5000, "\u0663", "05"]),
                              floats | st.integers(-120, 120), max_size=4)
              | st.just({str(i): 1.0 for i in range(301)}) | JSON)
PROMPTS = (texts | id_lists | st.lists(id_lists, max_size=3) | st.lists(texts, max_size=3)
           | st.just([[]]) | st.just([""]) | st.just(["hi"] * 300) | JSON)

SAMPLING = {
    "model": texts, "max_tokens": ints, "max_completion_tokens": ints, "temperature": floats, "top_p": floats,
    "top_k": ints | st.sampled_from(IDS), "seed": ints, "n": ints, "best_of": ints, "min_tokens": ints,
    "stop": texts | st.lists(texts, max_size=4) | st.just(["a"] * 17) | st.just([""]),
    "stop_token_ids": id_lists, "stream": bools, "ignore_eos": bools, "skip_special_tokens": bools,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": bools, "continuous_usage_stats": bools})
                      | JSON,
    "response_format": RESPONSE_FORMATS, "user": texts, "presence_penalty": floats, "frequency_penalty": floats,
    "repetition_penalty": floats, "min_p": floats, "logit_bias": LOGIT_BIAS, "structured_outputs": STRUCTURED,
    "guided_choice": CHOICES, "guided_regex": REGEXES, "guided_json": SCHEMAS, "guided_grammar": GRAMMARS,
    "guided_whitespace_pattern": WHITESPACE, "include_stop_str_in_output": bools,
    "spaces_between_special_tokens": bools,
    "allowed_token_ids": id_lists, "bad_words": st.lists(texts, max_size=3) | JSON, "truncate_prompt_tokens": ints,
    "cache_salt": texts, "add_special_tokens": bools, "return_token_ids": bools,
    "return_tokens_as_token_ids": bools, "prompt_cache_key": texts, "safety_identifier": texts,
}
TEMPLATE_KWARGS = (st.dictionaries(st.sampled_from(["enable_thinking", "tools", "messages", "x" * 100, ""]),
                                   JSON, max_size=3) | JSON)
COMPLETIONS = {**SAMPLING, "prompt": PROMPTS, "logprobs": ints, "echo": bools, "suffix": texts,
               "prompt_logprobs": ints}
CHAT = {**SAMPLING, "messages": MESSAGES, "logprobs": bools, "top_logprobs": ints, "tools": TOOLS,
        "tool_choice": TOOL_CHOICE, "parallel_tool_calls": bools, "chat_template_kwargs": TEMPLATE_KWARGS,
        "add_generation_prompt": bools, "continue_final_message": bools, "prompt_logprobs": ints,
        "reasoning_effort": st.sampled_from(["low", "high", "none", "extreme", ""]) | texts}
TOKENIZE = {"model": texts, "prompt": texts | JSON, "messages": MESSAGES, "add_special_tokens": bools,
            "add_generation_prompt": bools, "return_token_strs": bools, "continue_final_message": bools,
            "chat_template_kwargs": TEMPLATE_KWARGS}
RESPONSES = {"model": texts, "input": texts | st.lists(st.fixed_dictionaries(
                 {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool"])},
                 optional={"content": texts | JSON, "type": st.sampled_from(["message", "function_call", "x"])}),
                 max_size=3) | JSON,
             "instructions": texts, "max_output_tokens": ints, "temperature": floats, "top_p": floats,
             "tools": TOOLS, "tool_choice": TOOL_CHOICE, "parallel_tool_calls": bools,
             "text": st.fixed_dictionaries({}, optional={"format": st.fixed_dictionaries(
                 {"type": st.sampled_from(["json_schema", "json_object", "text", "x"])},
                 optional={"name": texts, "schema": SCHEMAS, "strict": bools})}) | JSON,
             "stream": bools, "store": bools, "previous_response_id": texts,
             "metadata": st.dictionaries(texts, texts, max_size=3) | JSON, "user": texts,
             "prompt_cache_key": texts, "safety_identifier": texts,
             "truncation": st.sampled_from(["disabled", "auto"]) | JSON, "seed": ints, "top_k": ints,
             "include": st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content", "x"]),
                                 max_size=3) | JSON, "top_logprobs": ints,
             "reasoning": st.fixed_dictionaries({}, optional={
                 "effort": st.sampled_from(["low", "high", "x"]) | JSON,
                 "summary": st.sampled_from(["auto", "detailed"]) | JSON}) | JSON}
DETOKENIZE = {"model": texts, "tokens": id_lists | JSON}
LOAD_ADAPTER = {"lora_name": texts | st.just("tiny"),
                "lora_path": texts | st.sampled_from(["", ".", "/", "/proc/self", "/dev/zero", "x" * 5000]),
                "load_inplace": bools | JSON}
UNLOAD_ADAPTER = {"lora_name": texts | st.just("tiny"), "lora_int_id": ints | JSON}

# route -> (valid bases: the mutations start from one of them, the first is the sweep's base; field strategies)
ROUTES: dict[str, tuple[list[dict[str, Any]], dict[str, st.SearchStrategy[Any]]]] = {
    "/v1/completions": ([{"model": "tiny", "prompt": "def f(", "max_tokens": 4, "min_tokens": 1,
                          "presence_penalty": 0.5, "logit_bias": {"5": 1.0}, "logprobs": 2},
                         {"model": "tiny", "prompt": "hi", "max_tokens": 2},
                         {"model": "tiny", "prompt": [5, 6], "max_tokens": 3, "stream": True,
                          "stream_options": {"include_usage": True}, "n": 2, "seed": 1}], COMPLETIONS),
    "/v1/chat/completions": ([{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                               "min_tokens": 1, "repetition_penalty": 1.2, "logprobs": True, "top_logprobs": 2},
                              {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                              {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                               "stream": True, "guided_choice": ["yes", "no"]}], CHAT),
    "/tokenize": ([{"model": "tiny", "prompt": "hi"},
                   {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}], TOKENIZE),
    "/detokenize": ([{"model": "tiny", "tokens": [1, 2]}], DETOKENIZE),
    "/v1/responses": ([{"model": "tiny", "input": "hi", "max_output_tokens": 4, "temperature": 0.5, "top_k": 5,
                        "include": ["message.output_text.logprobs"], "top_logprobs": 2},
                       {"model": "tiny", "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 3,
                        "stream": True, "include": ["message.output_text.logprobs"]}], RESPONSES),
    "/v1/load_lora_adapter": ([{"lora_name": "fuzz", "lora_path": "/nonexistent/adapter"}], LOAD_ADAPTER),
    "/v1/unload_lora_adapter": ([{"lora_name": "fuzz"}], UNLOAD_ADAPTER),
}
FIELD_NAMES = sorted({f for _, fields in ROUTES.values() for f in fields} | {"frobnicate", ""})


SWEEP_WRONG_TYPES = [None, "1", [1], {"a": 1}]   # the sweep's share of WRONG_TYPES (one parse path)


def extremes(strategy_values: list[Any]) -> list[Any]:
    return strategy_values + SWEEP_WRONG_TYPES


FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
# the float fields are swept with a grammar too: a row of NaN probabilities would pick a token the mask forbids
CONSTRAINED = {"response_format": {"type": "json_object"}}
EXTREMES: dict[str, list[Any]] = {
    **{f: extremes(INTS) for f in ("max_tokens", "max_completion_tokens", "top_k", "seed", "n", "best_of",
                                   "min_tokens", "logprobs", "top_logprobs", "prompt_logprobs",
                                   "max_output_tokens")},
    "chat_template_kwargs": [{}, {"enable_thinking": True}, {"messages": []}, {"tools": 1}, {"x" * 1000: 1}]
                            + SWEEP_WRONG_TYPES,
    "guided_whitespace_pattern": ["[ ]*", "x", "(", "[^\\s\\S]", " {1000000}"] + SWEEP_WRONG_TYPES,
    **{f: extremes(FLOATS) for f in FLOAT_FIELDS},
    "stop_token_ids": [[i] for i in IDS] + [[], [TOKENIZER_VOCAB] * 65, [1] * 10_000] + SWEEP_WRONG_TYPES,
    "tokens": [[i] for i in IDS] + [[], [1] * 10_000] + SWEEP_WRONG_TYPES,
    "prompt": [[i] for i in IDS] + [[], [[]], [""], "", HUGE_TEXT, [[1], [MODEL_VOCAB]], ["a"] * 2049]
              + SWEEP_WRONG_TYPES,
    "logit_bias": [{str(i): 1.0} for i in IDS if i >= 0] + [{"1" * 5000: 1.0}, {"5": float("nan")},
                                                            {"5": 101}, {str(i): 1.0 for i in range(301)}]
                  + SWEEP_WRONG_TYPES,
    "stop": ["", [""], ["a"] * 17, "x" * 5000] + SWEEP_WRONG_TYPES,
    "allowed_token_ids": [[i] for i in IDS] + [[], [TOKENIZER_VOCAB] * 65, list(range(MODEL_VOCAB)),
                                               [1] * 10_000] + SWEEP_WRONG_TYPES,
    "bad_words": [[""], [" \t"], ["\u200b"], ["\ufeff"], ["x" * 1025], ["w"] * 129, ["def", " f", "(("], ["\x00"]]
                 + SWEEP_WRONG_TYPES,
    "truncate_prompt_tokens": extremes(INTS) + [-1, 0, 1, 2, 63, 64, 65],
    "reasoning_effort": ["low", "max", "", "HIGH"] + SWEEP_WRONG_TYPES,
    "cache_salt": ["", "a", "x" * 1025, "\x00", "\ud800", "tiny"] + SWEEP_WRONG_TYPES,
    "prompt_cache_key": ["", "x" * 1024, "x" * 1025, "\x00", "\ud800"] + SWEEP_WRONG_TYPES,
    "safety_identifier": ["", "x" * 64, "x" * 65, "\x00", "\ud800"] + SWEEP_WRONG_TYPES,
    "guided_choice": [[], [""], ["a"] * 1025] + SWEEP_WRONG_TYPES,
    "guided_regex": ["[^\\s\\S]", "[b&&c]", "", "("] + SWEEP_WRONG_TYPES,
    "guided_json": EMPTY_LANGUAGE + SWEEP_WRONG_TYPES,
    "guided_grammar": ['root ::= root "a"', 'root ::= a\na ::= "x" a', 'root ::= [^\\x00-\\U0010FFFF]', ""]
                      + SWEEP_WRONG_TYPES,
    "messages": [[], [{"role": "user", "content": HUGE_TEXT}], [{"role": "user"}], [{"role": "tool", "content": ""}],
                 [{"role": "user", "content": []}], [{"role": "user", "content": [{"type": "image", "text": "x"}]}],
                 [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                        "function": {"name": "f", "arguments": "{"}}]}]]
                + SWEEP_WRONG_TYPES,
    "tools": [[], [{"type": "function", "function": {"name": "f", "parameters": schema}}
                   for schema in EMPTY_LANGUAGE[:3]], [{"type": "function", "function": {"name": ""}}] * 2]
             + SWEEP_WRONG_TYPES,
    "tool_choice": ["required", "any", {"type": "function", "function": {"name": "missing"}}] + SWEEP_WRONG_TYPES,
    "include": [[], ["message.output_text.logprobs"] * 17, ["reasoning.encrypted_content"], [""], [None]]
               + SWEEP_WRONG_TYPES,
    "reasoning": [{}, {"effort": "high"}, {"effort": None, "summary": None}, {"summary": "auto"}, {"effort": 5},
                  {"x": 1}] + SWEEP_WRONG_TYPES,
    "lora_name": ["", "tiny", "x" * 5000, "../x", "\x00"] + SWEEP_WRONG_TYPES,
    "lora_path": ["", ".", "/", "/proc/self", "/dev/zero", "x" * 5000, "\x00"] + SWEEP_WRONG_TYPES,
    "load_inplace": [True, False, 0, 1] + SWEEP_WRONG_TYPES,
    **{f: [True, False, 0, 1, "true"] + SWEEP_WRONG_TYPES
       for f in ("return_token_ids", "return_tokens_as_token_ids")},
    "lora_int_id": [0, -1, 2**63, 1.5, True] + SWEEP_WRONG_TYPES,
}
# the sampling fields go through the same code on both routes: swept on /v1/completions only
SWEPT = {path: sorted(set(fields) & set(EXTREMES) - (set(SAMPLING) if path == "/v1/chat/completions" else set()))
         for path, (_, fields) in ROUTES.items()}


def mutated(path: str) -> st.SearchStrategy[dict[str, Any]]:
    """A valid base with 1-3 fields set to targeted values (or any field to JSON) and some fields dropped."""
    bases, fields = ROUTES[path]
    names = sorted(fields)
    targeted = st.sampled_from(names).flatmap(lambda f: st.tuples(st.just(f), fields[f]))
    anything = st.sampled_from(FIELD_NAMES).flatmap(lambda f: st.tuples(st.just(f), fields.get(f, JSON) | JSON))
    updates = st.lists(targeted | targeted | targeted | anything, min_size=1, max_size=3).map(dict)
    return st.tuples(st.sampled_from(bases), updates, st.sets(st.sampled_from(names), max_size=1)).map(
        lambda bud: {**{k: v for k, v in bud[0].items() if k not in bud[2]}, **bud[1]})


def encode(value: Any, ascii_only: bool) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def bodies(path: str) -> st.SearchStrategy[bytes]:
    """Mostly mutated valid bodies, some random JSON or bytes, and the route's valid bodies themselves: a route whose
    every field is constrained (/tokenize) yields few valid bodies by mutation, and a run of 50 examples once had
    none, so the accepted path went unexercised (tests/test_gateway/api/test_fuzz_bodies.py)."""
    valid = st.sampled_from(ROUTES[path][0])
    as_json = st.tuples(st.one_of(mutated(path), mutated(path), mutated(path), JSON, valid), st.booleans()).map(
        lambda va: encode(*va))
    return st.one_of(as_json, as_json, as_json, as_json, st.binary(max_size=64))
