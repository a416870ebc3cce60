"""Issue 31: a schema's lowering is bounded like its compilation, and runs in the killable compile workers.

The finding: `S0 = {"type": "integer"}`, `S(k+1) = {"type": "array", "items": S(k), "maxItems": 2}` (1 KB at depth
30) was lowered to a regex in the API process, each level copying its items' regex twice: depth 30 grew to 22 GB.
Here: admission never lowers (a recipe travels to the worker), the regex builder stops at its budget with no
string over it ever built, the prune loop is bounded, and a compile past the worker's memory limit is a 400 and
a restarted worker. The same for tool schemas, guided_json / structured_outputs.json and regexes.
"""
from __future__ import annotations

import time
import tracemalloc
from typing import Any, Iterator

import pytest
from grammar_helpers import json_schema_format, lowered

from grammar import GrammarCompiler, GrammarError, SchemaOptions, parse_response_format
from grammar.specs.constraints import json_spec, parse_constraints
from grammar.compile.lowering import RegexBudgetError, schema_to_regex
from grammar.regex.builder import RegexBuilder, RegexTooLarge
from grammar.schema.lowering import Lowerer
from grammar.specs.tool_calls import HERMES, FunctionSpec, tool_calls_spec

BUDGET = 100_000
OPTIONS = SchemaOptions(max_regex_chars=BUDGET, target_regex_chars=BUDGET // 4)


def nested_arrays(depth: int, min_items: int = 0) -> dict[str, Any]:
    """The issue's schema (min_items 0); with min_items 2 no pruning can shrink it."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "maxItems": 2}
        if min_items:
            schema["minItems"] = min_items
    return schema


def nested_maps(depth: int) -> dict[str, Any]:
    """Free-form members whose values nest: each level writes its member's regex twice."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "additionalProperties": schema, "maxProperties": 3}
    return schema


def ref_chain_any_of(depth: int) -> dict[str, Any]:
    """anyOf branches through $refs: linear text, exponentially many paths (bounded by the lowering steps)."""
    defs: dict[str, Any] = {"d0": {"type": "integer"}}
    for k in range(depth):
        ref = {"$ref": f"#/$defs/d{k}"}
        defs[f"d{k + 1}"] = {"anyOf": [{"type": "object", "properties": {"a": ref}, "required": ["a"]},
                                       {"type": "array", "items": ref, "minItems": 1, "maxItems": 1}]}
    return {"$defs": defs, "$ref": f"#/$defs/d{depth}"}


@pytest.fixture()
def no_lowering_here(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Lowering in this process fails the test (the compile workers are other processes: unaffected)."""
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a schema was lowered in the serving process")

    monkeypatch.setattr(Lowerer, "lower_root", forbidden)
    monkeypatch.setattr(RegexBuilder, "build", forbidden)
    yield


@pytest.fixture(scope="module")
def small_compiler(bpe_tokenizer: Any) -> Iterator[GrammarCompiler]:
    c = GrammarCompiler(bpe_tokenizer, len(bpe_tokenizer), [bpe_tokenizer.eos_token_id], compile_timeout_s=20.0,
                        num_workers=1)
    yield c
    c.close()


# -- the builder's budget --------------------------------------------------------------------------------------
@pytest.mark.parametrize("schema", [nested_arrays(30, min_items=2), nested_maps(30)], ids=["arrays", "maps"])
def test_builder_stops_at_its_budget_without_building_past_it(schema: dict[str, Any]) -> None:
    node = Lowerer(schema, SchemaOptions()).lower_root()
    tracemalloc.start()
    try:
        start = time.perf_counter()
        with pytest.raises(RegexTooLarge) as info:
            RegexBuilder(max_chars=BUDGET).build(node)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.max_chars == BUDGET
    assert peak < 8 * BUDGET, peak          # a few strings of at most the budget, never 2^30 copies
    assert time.perf_counter() - start < 2.0


def test_builder_with_budget_builds_the_same_regex_below_it() -> None:
    schema = nested_arrays(6)
    node = Lowerer(schema, SchemaOptions()).lower_root()
    regex = RegexBuilder().build(node)
    assert RegexBuilder(max_chars=len(regex)).build(node) == regex
    with pytest.raises(RegexTooLarge):
        RegexBuilder(max_chars=len(regex) - 1).build(node)


def test_schema_over_the_budget_is_an_error_naming_it() -> None:
    tracemalloc.start()
    try:
        with pytest.raises(RegexBudgetError) as info:
            schema_to_regex(nested_arrays(30, min_items=2), OPTIONS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    error = info.value
    assert error.code == "unsupported_json_schema" and error.pointer == "#"
    assert f"would exceed {BUDGET} characters (the limit for this model)" in error.message
    assert peak < 20 * BUDGET, peak


def test_branching_through_refs_stops_at_the_lowering_steps() -> None:
    start = time.perf_counter()
    with pytest.raises(GrammarError) as info:
        schema_to_regex(ref_chain_any_of(24), OPTIONS)
    assert "steps" in info.value.message and time.perf_counter() - start < 5.0


def ref_chain(length: int, shape: str) -> dict[str, Any]:
    """`length` distinct $defs, each one level around the next: a small text nested `length` subschemas deep."""
    defs: dict[str, Any] = {f"d{length}": {"type": "null"}}
    for k in range(length):
        ref = {"$ref": f"#/$defs/d{k + 1}"}
        defs[f"d{k}"] = {"anyOf": [ref, {"type": "integer"}]} if shape == "anyOf" else \
            {"type": "object", "properties": {"x": ref}}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


@pytest.mark.parametrize("shape", ["anyOf", "members"])
@pytest.mark.parametrize("length", [80, 300, 900])
def test_a_long_ref_chain_is_refused_at_the_nesting_bound(shape: str, length: int) -> None:
    """A chain of distinct $defs reached Python's recursion limit wherever it happened to be: a RecursionError
    ('too deeply nested', no place named), regex-automata's 'Failed to build DFA', or, inside the `referencing`
    library's Rust registry, a pyo3 PanicException (a BaseException: past every `except Exception`, it killed
    the compile worker). Now one 400 naming the bound and where it stopped."""
    with pytest.raises(GrammarError) as info:
        schema_to_regex(ref_chain(length, shape), SchemaOptions())
    assert info.value.code == "unsupported_json_schema"
    assert "more than 64 subschemas deep" in info.value.message and "stopped at '#/$defs/d" in info.value.message
    schema_to_regex(ref_chain(20, shape), SchemaOptions())   # 20 deep (the bench's deepest is 19): served


def test_a_library_panic_while_lowering_is_a_400(monkeypatch: pytest.MonkeyPatch) -> None:
    class PanicException(BaseException):   # pyo3's, as a Rust library raises it
        pass

    def panic(*args: Any, **kwargs: Any) -> Any:
        raise PanicException("__eq__ failed!")

    monkeypatch.setattr(Lowerer, "lower_root", panic)
    with pytest.raises(GrammarError) as info:
        schema_to_regex({"type": "integer"}, SchemaOptions())
    assert info.value.code == "unsupported_json_schema"


def test_the_issue_schema_is_pruned_within_the_budget() -> None:
    """maxItems without minItems: the arrays below the prune depth become empty, a subset that fits."""
    regex = schema_to_regex(nested_arrays(30), OPTIONS)
    assert len(regex) <= OPTIONS.target_regex_chars


def test_prune_loop_runs_a_bounded_number_of_budgeted_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    import grammar.compile.lowering as lowering

    calls: list[int] = []
    real = lowering._lower

    def counted(schema: Any, options: SchemaOptions, max_chars: int) -> str:
        calls.append(max_chars)
        return real(schema, options, max_chars)

    monkeypatch.setattr(lowering, "_lower", counted)
    with pytest.raises(RegexBudgetError):
        schema_to_regex(nested_arrays(30, min_items=2), OPTIONS)
    assert len(calls) == 1 + len(lowering.PRUNE_DEPTHS) and max(calls) <= BUDGET


# -- admission never lowers ------------------------------------------------------------------------------------
def test_admission_carries_a_recipe_and_never_lowers(no_lowering_here: None) -> None:
    spec = parse_response_format(json_schema_format(nested_arrays(30)))
    guided = parse_constraints(None, {"guided_json": nested_arrays(30)}, None)
    assert spec is not None and spec.regex == "" and spec.recipe is not None
    assert guided is not None and guided.param == "guided_json" and guided.recipe == spec.recipe
    assert spec.key == guided.key   # the cache and de-dup key hashes the recipe, not a regex


def test_admission_still_rejects_bad_shapes_at_once(no_lowering_here: None) -> None:
    with pytest.raises(GrammarError) as info:
        parse_response_format(json_schema_format({"type": "array", "maxItems": -1}))
    assert info.value.code == "invalid_json_schema"
    with pytest.raises(GrammarError) as info:
        parse_response_format(json_schema_format(nested_arrays(70)))
    assert info.value.code == "unsupported_json_schema" and "deeper than" in info.value.message


# -- in the worker: the same 400s ------------------------------------------------------------------------------
def test_worker_lowering_error_is_the_admission_error(small_compiler: GrammarCompiler, no_lowering_here: None) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0.01}}, "required": ["a"]}
    for rf_spec, param in ((parse_response_format(json_schema_format(schema)), "response_format.json_schema.schema"),
                           (parse_constraints(None, {"guided_json": schema}, None), "guided_json"),
                           (parse_constraints({"json": schema}, {}, None), "structured_outputs.json")):
        with pytest.raises(GrammarError) as info:
            small_compiler.compile(rf_spec)
        assert (info.value.code, info.value.param, info.value.pointer) == (
            "unsupported_json_schema", param, "#/properties/a/multipleOf"), info.value
        assert "multipleOf" in info.value.message


def test_worker_refuses_a_schema_over_the_budget(small_compiler: GrammarCompiler, no_lowering_here: None) -> None:
    spec = parse_response_format(json_schema_format(nested_arrays(30, min_items=2)), OPTIONS)
    start = time.perf_counter()
    with pytest.raises(GrammarError) as info:
        small_compiler.compile(spec)
    assert time.perf_counter() - start < 10.0
    assert info.value.code == "unsupported_json_schema"
    assert f"would exceed {BUDGET} characters" in info.value.message
    assert small_compiler.compile(parse_response_format(json_schema_format(nested_arrays(30)), OPTIONS)) is not None


def test_tool_schemas_are_lowered_in_the_worker(small_compiler: GrammarCompiler, no_lowering_here: None) -> None:
    ok = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    bomb = {"type": "object", "properties": {"x": nested_arrays(30, min_items=2)}, "required": ["x"]}
    fns = [FunctionSpec(f"f{i}", json_spec(s, f"tools[{i}].function.parameters", OPTIONS).recipe, "{}",
                        f"tools[{i}].function.parameters") for i, s in enumerate([ok, bomb])]
    with pytest.raises(GrammarError) as info:   # callable
        small_compiler.compile(tool_calls_spec(HERMES, fns, parallel=True))
    assert info.value.param == "tools[1].function.parameters" and "would exceed" in info.value.message
    with pytest.raises(GrammarError) as info:   # named another function: still checked
        small_compiler.compile(tool_calls_spec(HERMES, fns[:1], parallel=False, checked=fns))
    assert info.value.param == "tools[1].function.parameters"
    with pytest.raises(GrammarError) as info:   # tool_choice "none": a check, no compile
        small_compiler.check(tool_calls_spec(HERMES, [], parallel=True, checked=fns)).result(30)
    assert info.value.param == "tools[1].function.parameters"
    assert small_compiler.check(tool_calls_spec(HERMES, [], parallel=True, checked=fns[:1])).result(30) is None
    assert small_compiler.compile(tool_calls_spec(HERMES, fns[:1], parallel=True)) is not None


def test_tool_call_regex_has_one_budget_in_all() -> None:
    """Each callable function's regex fits the budget alone; together they do not."""
    leaf = {"type": "string", "maxLength": 8}
    names = [f"p{i}" for i in range(40)]
    schema = {"type": "object", "properties": {name: leaf for name in names}, "required": names}
    one = len(schema_to_regex(schema, SchemaOptions()))
    options = SchemaOptions(max_regex_chars=one * 3 // 2, target_regex_chars=one * 3 // 2)
    fns = [FunctionSpec(f"f{i}", json_spec(schema, f"tools[{i}].function.parameters", options).recipe, "{}",
                        f"tools[{i}].function.parameters") for i in range(3)]
    with pytest.raises(GrammarError) as info:
        lowered(tool_calls_spec(HERMES, fns, parallel=True))
    assert info.value.param == "tools[1].function.parameters"
    assert f"would exceed {one * 3 // 2} characters" in info.value.message


# -- the worker's memory limit ---------------------------------------------------------------------------------
def test_memory_limit_is_a_400_and_a_restarted_worker(bpe_tokenizer: Any) -> None:
    """Python (the lowering) and Rust (the index) allocations both stop at the limit; the next compile works."""
    compiler = GrammarCompiler(bpe_tokenizer, len(bpe_tokenizer), [bpe_tokenizer.eos_token_id],
                               compile_timeout_s=30.0, num_workers=1, worker_memory_bytes=256 << 20)
    try:
        assert compiler.compile(parse_constraints(None, {"guided_regex": "ab+"}, None)) is not None
        unbudgeted = SchemaOptions(max_regex_chars=10**12, target_regex_chars=10**5)
        cases = [(parse_response_format(json_schema_format(nested_arrays(32, min_items=2)), unbudgeted),
                  "unsupported_json_schema", "response_format.json_schema.schema"),
                 (parse_constraints(None, {"guided_regex": "(a|b)*a(a|b){20}"}, None), "invalid_regex", "guided_regex")]
        for num, (spec, code, param) in enumerate(cases, start=1):
            start = time.perf_counter()
            with pytest.raises(GrammarError) as info:
                compiler.compile(spec)
            assert time.perf_counter() - start < 25.0
            assert (info.value.code, info.value.param) == (code, param), info.value
            assert "256 MiB (the compile worker's memory limit)" in info.value.message
            assert compiler._pool.restarts == num
            assert compiler.compile(parse_constraints(None, {"guided_regex": f"x{num}y+"}, None)) is not None
            compiler.check_integrity()
    finally:
        compiler.close()
