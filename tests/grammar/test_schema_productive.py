"""Subschemas no finite JSON value satisfies become `false`; the language of JSON values stays the same."""

from __future__ import annotations

import time

import jsonschema
import pytest
from loraplex.grammar.schema.productive import (
    admits_no_finite_value,
    with_unproductive_as_false,
    without_unproductive_choices,
)

SELF = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
ENDLESS_DEF = {"type": "object", "properties": {"a": {"$ref": "#/$defs/endless"}}, "required": ["a"]}


@pytest.mark.parametrize("schema", [
    SELF,
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"},
    {"type": "array", "minItems": 2, "items": {"$ref": "#"}},
    {"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}], "minItems": 2},
    {"type": "array", "items": [{"type": "string"}], "additionalItems": {"$ref": "#"}, "minItems": 3},  # draft 4-7
    {"type": "array", "contains": {"$ref": "#"}},
    {"type": "object", "required": ["x"], "additionalProperties": {"$ref": "#"}},
    {"anyOf": [SELF, {"$ref": "#/anyOf/0"}]},
    {"type": ["object", "array"], "properties": {"p": {"$ref": "#"}}, "required": ["p"], "minItems": 1,
     "items": {"$ref": "#"}},
], ids=["required-self", "bare-self-ref", "refs-in-a-ring", "min-items-of-self", "prefix-item-of-self",
        "draft7-additional-items", "contains-self", "additional-property-required", "any-of-endless-branches",
        "object-or-array-both-endless"])
def test_schemas_whose_every_value_never_ends(schema):
    assert admits_no_finite_value(schema)
    assert with_unproductive_as_false(schema) is False


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
    {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["next"]},
    {"properties": {"next": {"$ref": "#"}}, "required": ["next"]},  # no type: a string satisfies it
    {"type": "object", "properties": {"next": {"$ref": "#"}}},      # not required: {} ends it
    {"type": "object", "patternProperties": {"^n": {"$ref": "#"}}, "required": ["next"]},  # left to patterns
    {"type": "array", "contains": {"$ref": "#"}, "minContains": 0},
    {"enum": [{"next": None}], "type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    {"type": "object", "properties": {"n": {"$ref": "#/definitions/a/full"}}, "required": ["n"],
     "definitions": {"a": {"full": {"type": "string"}}}},  # a target outside the keywords: not judged here
    {"type": "object", "properties": {"n": {"$ref": "https://example.com/s.json"}}, "required": ["n"]},
], ids=["tree", "linked-list", "no-type", "not-required", "pattern-owned", "min-contains-0", "enum", "deep-ref",
        "remote-ref"])
def test_recursive_schemas_with_a_way_out_are_kept(schema):
    assert not admits_no_finite_value(schema)
    assert with_unproductive_as_false(schema) is schema


def test_an_endless_branch_becomes_false_and_the_rest_is_untouched():
    schema = {"type": "object", "required": ["x"],
              "properties": {"x": {"anyOf": [{"$ref": "#/$defs/endless"}, {"type": "string"}]},
                             "y": {"$ref": "#/$defs/endless"}},
              "$defs": {"endless": ENDLESS_DEF}}
    before = repr(schema)
    pruned = with_unproductive_as_false(schema)
    assert repr(schema) == before, "the input is left alone"
    assert pruned["properties"]["x"]["anyOf"] == [False, {"type": "string"}]
    assert pruned["properties"]["y"] is False and pruned["$defs"]["endless"] is False
    values = [{"x": "a"}, {"x": "a", "y": 1}, {"x": {}}, {}, {"x": "a", "z": None}, "s"]
    for value in values:
        assert jsonschema.Draft202012Validator(schema).is_valid(value) == \
            jsonschema.Draft202012Validator(pruned).is_valid(value), value


def test_a_chain_of_thousands_of_references_is_judged_in_linear_time():
    """A hostile schema: 5,000 definitions each requiring the next; its last either ends or loops to the first."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(5000)}
    for last, endless in (({"type": "string"}, False), ({"$ref": "#/$defs/d0"}, True)):
        schema = {"$ref": "#/$defs/d0", "$defs": {**defs, "d5000": last}}
        started = time.perf_counter()
        assert admits_no_finite_value(schema) is endless
        assert time.perf_counter() - started < 2.0


def test_for_a_backend_without_false_only_the_endless_choices_go():
    schema = {"type": "object", "required": ["x"],
              "properties": {"x": {"oneOf": [{"$ref": "#/$defs/endless"}, {"type": "string"}, False]},
                             "y": {"$ref": "#/$defs/endless"}},
              "$defs": {"endless": ENDLESS_DEF}}
    pruned = without_unproductive_choices(schema)
    assert pruned["properties"]["x"]["oneOf"] == [{"type": "string"}]
    assert pruned["properties"]["y"] == {"$ref": "#/$defs/endless"}, "no `false` written anywhere"
    assert pruned["$defs"] == schema["$defs"] and schema["properties"]["x"]["oneOf"][0] == {"$ref": "#/$defs/endless"}
    assert without_unproductive_choices(SELF) is not SELF  # a copy; its root is the caller's to refuse
