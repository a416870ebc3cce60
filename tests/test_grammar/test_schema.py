"""Admission: response_format validation, normalization, and rejection of what we cannot enforce."""

from __future__ import annotations

import json

import pytest
from grammar_helpers import admit, json_schema_format, matches

from grammar import GrammarError, GrammarSpec


def regex_of(schema: object) -> str:
    spec = admit(json_schema_format(schema))
    assert spec is not None
    return spec.regex


def accepts(schema: object, text: str) -> bool:
    return matches(regex_of(schema), text)


# -- response_format object ------------------------------------------------------------
def test_text_and_none_mean_unconstrained() -> None:
    assert admit(None) is None
    assert admit({"type": "text"}) is None


def test_json_object_spec_is_stable() -> None:
    a = admit({"type": "json_object"})
    b = admit({"type": "json_object"})
    assert isinstance(a, GrammarSpec) and a.kind == "json_object" and a.key == b.key
    assert matches(a.regex, '{"a": [1, {"b": null}], "c": "x"}')
    assert not matches(a.regex, "[1]") and not matches(a.regex, '"x"')


@pytest.mark.parametrize(
    "rf, param",
    [
        ("json", "response_format"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "text", "extra": 1}, "response_format"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "response_format.json_schema.strict"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "bogus": 1}}, "response_format.json_schema"),
    ],
)
def test_invalid_response_format(rf: object, param: str) -> None:
    with pytest.raises(GrammarError) as info:
        admit(rf)  # type: ignore[arg-type]
    assert info.value.code == "invalid_response_format"
    assert info.value.param == param
    assert info.value.to_dict()["code"] == "invalid_response_format"


def test_spec_fields() -> None:
    spec = admit(
        {"type": "json_schema", "json_schema": {"name": "n", "strict": True, "schema": {"type": "integer"}}}
    )
    assert spec is not None and spec.kind == "json_schema" and spec.name == "n" and spec.strict is True
    assert json.loads(spec.schema_json or "") == {"type": "integer"}
    assert spec.validate_output("12") and not spec.validate_output('"12"') and not spec.validate_output("{")


# -- metaschema, size, depth -------------------------------------------------------------
def test_metaschema_violation_is_invalid_json_schema() -> None:
    with pytest.raises(GrammarError) as info:
        admit(json_schema_format({"type": "object", "properties": {"a": {"type": "strnig"}}}))
    assert info.value.code == "invalid_json_schema"
    assert "#/properties/a/type" in info.value.message
    assert info.value.param == "response_format.json_schema.schema"


class _CountingDict(dict):
    """A schema node that counts how often a walk reads its members."""
    reads = 0

    def values(self):  # type: ignore[override]
        _CountingDict.reads += 1
        return super().values()


def test_ten_megabyte_schema_rejected_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rejected by a bounded walk before any expensive work: no metaschema validation, and only the first
    ~256 KiB of nodes read (how fast is a benchmark figure: benchmarks/gateway_latency.py)."""
    import grammar.specs.spec

    props = {f"field_{i:06d}": _CountingDict(type="string", description="x" * 200) for i in range(50_000)}
    schema = {"type": "object", "properties": props}
    assert len(json.dumps(schema)) > 10_000_000
    monkeypatch.setattr(grammar.specs.spec, "check_metaschema",
                        lambda *a, **k: pytest.fail("a 10 MB schema reached metaschema validation"))
    _CountingDict.reads = 0
    with pytest.raises(GrammarError) as info:
        admit(json_schema_format(schema))
    assert info.value.code == "unsupported_json_schema" and "larger than" in info.value.message
    assert _CountingDict.reads < 2_000, f"{_CountingDict.reads} of 50000 property schemas read"


def test_deeply_nested_schema_rejected() -> None:
    schema: dict = {"type": "string"}
    for _ in range(200):
        schema = {"type": "array", "items": schema}
    with pytest.raises(GrammarError) as info:
        admit(json_schema_format(schema))
    assert "deeper" in info.value.message


# -- normalization -------------------------------------------------------------------------
def test_type_inferred_from_keywords() -> None:
    assert accepts({"properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a": 1}')
    assert not accepts({"properties": {"a": {"type": "integer"}}, "required": ["a"]}, '"s"')
    assert accepts({"items": {"type": "boolean"}}, "[true, false]")
    assert accepts({"maxLength": 2}, '"ab"') and not accepts({"maxLength": 2}, '"abc"')
    assert accepts({"format": "date"}, '"2024-02-28"')


def test_true_subschemas_and_empty_schema() -> None:
    schema = {"type": "object", "properties": {"a": True, "b": {}}, "required": ["a", "b"]}
    assert accepts(schema, '{"a": [1, "x"], "b": {"c": null}}')
    assert accepts(True, "1") and accepts({}, '"x"')


def test_local_refs_and_defs() -> None:
    schema = {
        "$defs": {"pos": {"type": "integer", "minimum": 1}},
        "definitions": {"name": {"type": "string", "maxLength": 3}},
        "type": "object",
        "properties": {"n": {"$ref": "#/$defs/pos"}, "s": {"$ref": "#/definitions/name"}},
        "required": ["n", "s"],
    }
    assert accepts(schema, '{"n": 5, "s": "abc"}')
    assert not accepts(schema, '{"n": 0, "s": "abc"}') and not accepts(schema, '{"n": 5, "s": "abcd"}')


def test_ref_with_siblings_applies_both() -> None:
    schema = {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 1}
    assert accepts(schema, '"a"') and not accepts(schema, '"ab"')


def test_allof_of_objects_is_merged_not_concatenated() -> None:
    schema = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]},
        ]
    }
    assert accepts(schema, '{"a": 1, "b": "x"}')
    assert not accepts(schema, '{"a": 1}{"b": "x"}')


def test_allof_additional_properties_false_forbids_other_members() -> None:
    schema = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
            {"properties": {"b": {"type": "string"}}},
        ]
    }
    assert accepts(schema, '{"a": 1}') and not accepts(schema, '{"a": 1, "b": "x"}')


def test_recursive_ref_is_bounded() -> None:
    schema = {
        "$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                           "next": {"$ref": "#/$defs/node"}}, "required": ["v"]}},
        "$ref": "#/$defs/node",
    }
    assert accepts(schema, '{"v": 1, "next": {"v": 2}}')


def test_unbounded_required_recursion_is_rejected() -> None:
    schema = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
              "$ref": "#/$defs/n"}
    with pytest.raises(GrammarError) as info:
        admit(json_schema_format(schema))
    assert "'$ref'" in info.value.message


def test_enum_values_filtered_by_sibling_constraints() -> None:
    schema = {"type": "string", "enum": ["a", "bb", 3, "ccc"], "maxLength": 2}
    assert accepts(schema, '"a"') and accepts(schema, '"bb"')
    assert not accepts(schema, "3") and not accepts(schema, '"ccc"')


# -- enforced keywords ---------------------------------------------------------------------
def test_integer_and_number_bounds_enforced() -> None:
    assert accepts({"type": "integer", "minimum": 3, "maximum": 17}, "17")
    assert not accepts({"type": "integer", "minimum": 3, "maximum": 17}, "18")
    assert not accepts({"type": "integer", "exclusiveMinimum": 3}, "3")
    assert accepts({"type": "number", "exclusiveMaximum": 1, "minimum": 0}, "0.999")
    assert not accepts({"type": "number", "exclusiveMaximum": 1, "minimum": 0}, "1")
    assert not accepts({"type": "number", "minimum": 0}, "-0.5")


def test_multiple_of_enumerated_in_small_ranges() -> None:
    schema = {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 20}
    assert accepts(schema, "15") and not accepts(schema, "16")


def test_string_length_with_pattern() -> None:
    schema = {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 4}
    assert accepts(schema, '"abcd"') and not accepts(schema, '"a"') and not accepts(schema, '"abcde"')


def test_unique_items_restricts_to_one_item() -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    assert accepts(schema, "[1]") and accepts(schema, "[]") and not accepts(schema, "[1, 1]")


def test_pattern_properties_not_matching_declared_members_are_harmless() -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "patternProperties": {"^x-": {"type": "integer"}}}
    assert accepts(schema, '{"name": "a"}')


def test_pattern_properties_applying_to_a_member_are_merged() -> None:
    schema = {"type": "object", "properties": {"x-a": {"type": "number"}}, "required": ["x-a"],
              "patternProperties": {"^x-": {"type": "integer"}}}
    assert accepts(schema, '{"x-a": 2}') and not accepts(schema, '{"x-a": 2.5}')


def test_one_of_made_exclusive() -> None:
    schema = {"type": "object", "properties": {"r": {"type": "number"}, "w": {"type": "number"}},
              "oneOf": [{"required": ["r"]}, {"required": ["w"]}]}
    assert accepts(schema, '{"r": 1}') and accepts(schema, '{"w": 1}')
    assert not accepts(schema, '{"r": 1, "w": 2}')


def test_not_enforced_or_rejected() -> None:
    assert not accepts({"type": ["string", "integer"], "not": {"type": "integer"}}, "1")
    with pytest.raises(GrammarError) as info:
        admit(json_schema_format({"type": "string", "not": {"pattern": "^a"}}))
    assert info.value.code == "unsupported_json_schema" and "'not'" in info.value.message
    assert "#/not" in info.value.message


# -- rejected keywords ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "schema, keyword, pointer",
    [
        ({"type": "object", "properties": {"a": {"type": "array", "contains": {"type": "integer"}}},
          "required": ["a"]}, "contains", "#/properties/a"),
        ({"type": "number", "multipleOf": 0.01}, "multipleOf", "#/multipleOf"),
        ({"type": "string", "pattern": "(?=a)b"}, "pattern", "#/pattern"),
        ({"type": "string", "pattern": "^(a)\\1$"}, "pattern", "#/pattern"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "minItems": 2}, "uniqueItems", "#"),
        ({"$ref": "https://example.com/other.json"}, "$ref", "#"),
    ],
)
def test_unsupported_keyword_is_named_with_pointer(schema: object, keyword: str, pointer: str) -> None:
    with pytest.raises(GrammarError) as info:
        admit(json_schema_format(schema))
    err = info.value
    assert err.code == "unsupported_json_schema"
    assert f"'{keyword}'" in err.message and f"'{pointer}'" in err.message, err.message
    assert err.param == "response_format.json_schema.schema"


def test_unsupported_optional_member_is_rejected_like_a_required_one() -> None:
    """Never silently left out of what can be generated: the keyword and its pointer are named."""
    cases = [({"type": "array", "contains": {"type": "integer"}}, "contains", "#/properties/b"),
             ({"type": "number", "multipleOf": 0.01}, "multipleOf", "#/properties/b/multipleOf")]
    for member, keyword, pointer in cases:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": member}, "required": ["a"]}
        with pytest.raises(GrammarError) as info:
            admit(json_schema_format(schema))
        assert info.value.code == "unsupported_json_schema"
        assert f"'{keyword}'" in info.value.message and f"'{pointer}'" in info.value.message, info.value.message


def test_optional_member_no_value_satisfies_is_left_out_exactly() -> None:
    schema = {"type": "object", "required": ["a"],
              "properties": {"a": {"type": "integer"}, "b": False, "c": {"enum": [1, 2], "type": "string"}}}
    assert accepts(schema, '{"a": 1}')
    assert not accepts(schema, '{"a": 1, "b": 1}') and not accepts(schema, '{"a": 1, "c": 1}')


def test_invalid_python_regex_is_invalid_schema() -> None:
    with pytest.raises(GrammarError) as info:
        admit(json_schema_format({"type": "string", "pattern": "a{2,1}"}))
    assert info.value.code == "invalid_json_schema"


def test_unevaluated_properties_sees_only_its_own_subtree() -> None:
    extended = {"$defs": {"base": {"properties": {"a": {"type": "integer"}}}},
                "allOf": [{"$ref": "#/$defs/base"}], "properties": {"b": {"type": "string"}},
                "required": ["a", "b"], "unevaluatedProperties": False}
    assert accepts(extended, '{"b": "x", "a": 1}')
    sibling = {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"unevaluatedProperties": False}],
               "required": ["a"]}
    with pytest.raises(GrammarError):  # 'a' is unevaluated for the second branch: unsatisfiable
        admit(json_schema_format(sibling))


def test_ids_and_anchors() -> None:
    assert accepts({"$id": "http://example.com/s.json#", "$defs": {"x": {"$anchor": "X", "type": "string"}},
                    "$ref": "#X"}, '"s"')
    nested = {"type": "object", "required": ["sub"], "properties": {
        "sub": {"$id": "http://example.com/sub", "$defs": {"y": {"type": "null"}}, "$ref": "#/$defs/y"}}}
    assert accepts(nested, '{"sub": null}')


def test_pruning_keeps_required_members_when_over_budget() -> None:
    from grammar import SchemaOptions

    leaf = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(8)}, "required": ["p0"]}
    schema = {"type": "object", "properties": {f"k{i}": leaf for i in range(6)}, "required": ["k0"]}
    full = admit(json_schema_format(schema))
    small = admit(json_schema_format(schema), SchemaOptions(target_regex_chars=300))
    assert full is not None and small is not None and len(small.regex) < len(full.regex)
    assert matches(small.regex, '{"k0": {"p0": "x"}}')
    assert matches(full.regex, '{"k0": {"p0": "x", "p3": "y"}}')


def test_options_scale_with_vocabulary() -> None:
    from grammar import SchemaOptions

    tiny, big = SchemaOptions.for_vocab_size(512), SchemaOptions.for_vocab_size(128_256)
    assert big.target_regex_chars < tiny.target_regex_chars
    assert big.max_string_length < tiny.max_string_length
    schema = {"type": "string", "maxLength": 1000}
    regex = admit(json_schema_format(schema), big).regex  # type: ignore[union-attr]
    assert matches(regex, '"' + "a" * big.max_string_length + '"')
    assert not matches(regex, '"' + "a" * (big.max_string_length + 1) + '"')


def test_all_optional_objects_stay_linear() -> None:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 9} for i in range(8)}}
    regex = regex_of(schema)
    assert regex.count('"p7"') <= 2
    assert matches(regex, "{}") and matches(regex, '{"p0": "a", "p5": "b"}')


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "number", "exclusiveMinimum": 0.1, "exclusiveMaximum": 0.1000001},  # empty on the 1e-6 grid
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 0},
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},  # keys may repeat
        {"type": "string", "format": "date", "maxLength": 5},
    ],
)
def test_unsatisfiable_or_unenforceable_is_rejected_cleanly(schema: object) -> None:
    with pytest.raises(GrammarError) as info:
        admit(json_schema_format(schema))
    assert info.value.code == "unsupported_json_schema"


@pytest.mark.parametrize("schema, pointer", [
    ({"type": "array", "items": {"type": "integer", "multipleOf": 5}}, "#/items/multipleOf"),
    ({"type": "object", "required": ["tags"], "properties": {"tags": {"type": "array", "items": {
        "type": "string", "pattern": "^(?=x)"}}}}, "#/properties/tags/items/pattern"),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"contains": {"const": 1}}]}, "#/prefixItems/1"),
    ({"type": "object", "additionalProperties": {"type": "number", "multipleOf": 0.5}},
     "#/additionalProperties/multipleOf"),
    ({"type": "object", "patternProperties": {"^a_": {"type": "integer"}, "^b_": {"type": "string"}}}, "#"),
    ({"type": "object", "properties": {"m": {"type": "object", "propertyNames": {"format": "uri"},
                                             "patternProperties": {"^h": {}}}}}, "#/properties/m"),
    ({"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{200}$"}}},
     "#/properties/id/pattern"),
    ({"type": "object", "properties": {"to": {"type": "string", "format": "email", "maxLength": 5}}},
     "#/properties/to/format"),   # "a@b.c" is a valid email: only the addresses we write are longer
])
def test_unenforceable_item_or_member_is_rejected_not_left_out(schema: object, pointer: str) -> None:
    """Array items, map members and optional members follow the optional-property rule: a keyword the compiler
    cannot enforce is a 400 naming it. These were served as `[]` / `{}` forever (every item or member left
    out), a valid but useless answer the tenant could not tell from a model that chose to write nothing."""
    with pytest.raises(GrammarError) as info:
        admit(json_schema_format(schema))
    assert info.value.code == "unsupported_json_schema"
    assert f"'{pointer}'" in info.value.message, info.value.message


def test_dependent_required_trigger_is_never_a_free_form_key() -> None:
    """An object without declared names wrote any key, also the trigger of dependentRequired without the names it
    requires: {"a": 1} for propertyNames {"enum": ["a", "b"]} with "a" requiring "b"."""
    listed = {"type": "object", "propertyNames": {"enum": ["a", "b"]}, "dependentRequired": {"a": ["b"]}}
    assert accepts(listed, '{"b": 1}') and accepts(listed, "{}")
    assert not accepts(listed, '{"a": 1}') and not accepts(listed, '{"b": 1, "a": 2}')
    for keyword, dep in (("dependentRequired", ["b"]), ("dependentSchemas", {"required": ["b"]}),
                         ("dependencies", ["b"])):
        free = {"type": "object", "additionalProperties": {"type": "integer"}, keyword: {"a": dep}}
        with pytest.raises(GrammarError) as info:   # any key could be "a": refused, as other unplannable keys
            admit(json_schema_format(free))
        assert f"'{keyword}'" in info.value.message, info.value.message
    other = {"type": "object", "patternProperties": {"^x-[0-9]$": {"type": "integer"}}, "additionalProperties": False,
             "dependentRequired": {"a": ["b"]}}     # the trigger cannot match the pattern: members still written
    assert accepts(other, '{"x-1": 1}')


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "integer", "minimum": 5, "maximum": 4}, "maximum"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems"),
    ({"type": "object", "minProperties": 3, "maxProperties": 2}, "minProperties"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"], "additionalProperties": False}, "required"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "maxLength"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "type"),
    ({"type": "string", "format": "time", "maxLength": 8}, "format"),
])
def test_unsatisfiable_schema_names_the_keyword(schema: object, keyword: str) -> None:
    """'the schema admits no value that can be generated' named neither keyword nor place."""
    with pytest.raises(GrammarError) as info:
        admit(json_schema_format(schema))
    assert info.value.code == "unsupported_json_schema"
    assert f"'{keyword}'" in info.value.message and "'#" in info.value.message, info.value.message


def test_one_of_closed_objects_made_exclusive_by_requiring_a_member() -> None:
    """oneOf of objects with additionalProperties: false and only optional members (OpenAPI clients write these):
    `{}` validated every branch, so exclusivity was unprovable and the schema a 400. Each branch now requires one
    of the members the others forbid."""
    schema = {"oneOf": [
        {"type": "object", "additionalProperties": False, "properties": {"key": {"type": "string", "maxLength": 5}}},
        {"type": "object", "additionalProperties": False, "properties": {"keys": {"type": "array", "maxItems": 2,
                                                                                  "items": {"type": "string"}}}}]}
    assert accepts(schema, '{"key": "x"}') and accepts(schema, '{"keys": ["a"]}')
    assert not accepts(schema, "{}") and not accepts(schema, '{"key": "x", "keys": []}')
