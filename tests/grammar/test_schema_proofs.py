"""The proofs behind the exact rewrites (disjoint `oneOf` branches, `if` implying `then`, `$ref` targets
outside the walked tree): each rewritten schema keeps the language, checked with `jsonschema` over
values chosen to sit on both sides, and compiles to a grammar that accepts the valid values and
refuses the invalid ones."""

from __future__ import annotations

import json

import jsonschema
import pytest
from grammar_helpers import feed
from loraplex.grammar.schema.disjoint import Disjointness
from loraplex.grammar.schema.one_of_disjoint import with_disjoint_one_of_as_any_of
from loraplex.grammar.schema.passes import prepare_schema
from loraplex.grammar.schema.refs import with_reachable_ref_targets
from loraplex.grammar.schema.subset import subset
from loraplex.grammar.schema.walk import subschemas
from loraplex.grammar.spec import GrammarKind, GrammarSpec

JINJA = {"type": "string", "pattern": "\\{\\{.*\\}\\}"}
DISJOINT = [
    # branches whose required key is pinned through allOf and $ref
    ({"type": "object", "required": ["v"], "oneOf": [
        {"allOf": [{"properties": {"v": {"const": "1"}}}, {"$ref": "#/$defs/one"}]},
        {"allOf": [{"properties": {"v": {"const": "2"}}}, {"$ref": "#/$defs/two"}]}],
      "$defs": {"one": {"type": "object", "required": ["v"], "properties": {"v": {"const": "1"}, "a": {"type": "integer"}},
                        "additionalProperties": False},
                "two": {"type": "object", "required": ["v"], "properties": {"v": {"const": "2"}, "b": {"type": "string"}},
                        "additionalProperties": False}}},
     [{"v": "1"}, {"v": "1", "a": 3}, {"v": "2", "b": "x"}, {"v": "2", "a": 3}, {"v": "3"}, {"v": "1", "b": "x"}, 5]),
    # an anchored pattern whose alphabet lacks a character every match of the other branch needs
    ({"oneOf": [{"type": "string", "pattern": "^[a-z0-9_-]{0,64}$"}, JINJA]},
     ["abc", "", "{{ x }}", "a{{b}}", "{x}", "ABC", 3]),
    # branches that constrain objects only: any other value matches both, so the oneOf wants an object
    ({"oneOf": [{"properties": {"p": {"enum": ["m"]}}, "required": ["p"], "additionalProperties": False},
                {"properties": {"p": {"enum": ["v"]}, "code": {"type": "integer"}}, "required": ["p", "code"],
                 "additionalProperties": False}]},
     [{"p": "m"}, {"p": "v", "code": 1}, {"p": "m", "code": 1}, {"p": "v"}, "x", 3, None, []]),
    # a finite set none of whose values the other branch accepts
    ({"oneOf": [JINJA, {"type": "string", "enum": ["warn", "error"]}]},
     ["warn", "error", "{{ level }}", "info", "{{"]),
    # every object of one branch has two keys (each of its own branches requires two), the other's one
    ({"oneOf": [{"$ref": "#/$defs/repository"},
                {"type": "object", "additionalProperties": {"const": False}, "minProperties": 1, "maxProperties": 1}],
      "$defs": {"repository": {"type": "object", "oneOf": [
          {"required": ["type", "url"], "properties": {"type": {"const": "vcs"}}},
          {"required": ["type", "package"], "properties": {"type": {"const": "package"}}}]}}},
     [{"type": "vcs", "url": "u"}, {"type": "package", "package": 1}, {"x": False}, {"type": False},
      {"type": "vcs"}, {"x": True}, {"a": False, "b": False}, {}, "s"]),
]
NOT_DISJOINT = [
    # a string matches both (required and properties constrain objects only)
    {"oneOf": [{"required": ["k"], "properties": {"k": {"const": 1}}}, {"required": ["k"], "properties": {"k": {"const": 2}}}]},
    # "a{{b}}" matches both: the first pattern is not anchored
    {"oneOf": [{"type": "string", "pattern": "^[a-z]"}, JINJA]},
    # "{{x}}" is in the enum and matches the pattern
    {"oneOf": [JINJA, {"enum": ["{{x}}", "warn"]}]},
    # {"a": 1} has the one key both allow
    {"oneOf": [{"type": "object", "required": ["a"]}, {"type": "object", "maxProperties": 1}]},
]


def valid(schema, value) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def accepts(compiler, tokenizer, schema, value) -> bool:
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True))
    assert grammar.relaxed is None
    matcher, ok = feed(grammar, tokenizer, json.dumps(value, ensure_ascii=False))
    return ok and matcher.is_completed()


@pytest.mark.parametrize(("schema", "values"), DISJOINT, ids=[json.dumps(s)[:60] for s, _ in DISJOINT])
def test_disjoint_one_of_becomes_any_of_and_is_enforced_exactly(compiler, tokenizer, schema, values):
    rewritten = with_disjoint_one_of_as_any_of(schema)
    assert '"oneOf"' not in json.dumps(rewritten)
    assert any(valid(schema, v) for v in values) and any(not valid(schema, v) for v in values)
    for value in values:
        assert valid(rewritten, value) == valid(schema, value), value
        assert accepts(compiler, tokenizer, schema, value) == valid(schema, value), value


@pytest.mark.parametrize("schema", NOT_DISJOINT, ids=[json.dumps(s)[:60] for s in NOT_DISJOINT])
def test_overlapping_branches_are_not_called_disjoint(schema):
    a, b = schema["oneOf"]
    assert not Disjointness(schema).disjoint(a, b)


SOUNDS = {"type": "array", "if": {"items": {"type": "string"}}, "then": {"items": {"$ref": "#/$defs/path"}},
          "else": {"items": {"properties": {"name": {"$ref": "#/$defs/path"}, "volume": {"maximum": 1}}}},
          "$defs": {"path": {"$ref": "#/$defs/text", "description": "annotation only"}, "text": {"type": "string"}}}


def test_if_that_implies_then_is_rewritten_without_a_complement(compiler, tokenizer):
    rewritten = prepare_schema(SOUNDS).schema
    assert '"if"' not in json.dumps(rewritten)
    values = [[], ["a", "b"], ["a", {"name": "x"}], [{"name": 3}], ["a", {"volume": 2}], [{"volume": 0.5}, 7], "a"]
    assert any(valid(SOUNDS, v) for v in values) and any(not valid(SOUNDS, v) for v in values)
    for value in values:
        assert valid(rewritten, value) == valid(SOUNDS, value), value
        assert accepts(compiler, tokenizer, SOUNDS, value) == valid(SOUNDS, value), value


@pytest.mark.parametrize(("a", "b", "expected"), [
    ({"type": "integer"}, {"type": "number"}, True),
    ({"type": "number"}, {"type": "integer"}, False),
    ({"required": ["a", "b"], "properties": {"a": {"const": 1}}}, {"required": ["a"], "properties": {"a": {"type": "integer"}}}, True),
    ({"properties": {"a": {"type": "integer"}}}, {"properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}, False),
    ({"items": {"type": "string"}}, {"items": {"$ref": "#/$defs/s"}}, True),
    ({"prefixItems": [{"type": "integer"}], "items": {"type": "string"}}, {"items": {"type": "string"}}, False),
    ({"if": {"minimum": 1}, "then": {"maximum": 5}}, {"if": {"minimum": 2}, "then": {"maximum": 5}}, False),
    ({"allOf": [{"type": "string"}, {"minLength": 2}]}, {"anyOf": [{"type": "null"}, {"minLength": 2}]}, True),
])
def test_subset_proofs_are_sound(a, b, expected):
    root = {"$defs": {"s": {"type": "string"}}}
    assert subset(a, b, root) is expected


def test_ref_targets_outside_the_walked_tree_are_brought_into_view(compiler, tokenizer):
    schema = {"$ref": "#/definitions/a/full", "definitions": {
        "a": {"full": {"type": "object", "required": ["v"], "oneOf": [
            {"allOf": [{"$ref": "#/definitions/b/full"}]}, {"allOf": [{"$ref": "#/definitions/c/full"}]}]}},
        "b": {"full": {"type": "object", "required": ["v"], "properties": {"v": {"const": 1}}}},
        "c": {"full": {"type": "object", "required": ["v"], "properties": {"v": {"const": 2}, "w": {"type": "string"}}}}}}
    hoisted = with_reachable_ref_targets(schema)
    walked = [node for _, node, _ in subschemas(hoisted)]
    assert any(isinstance(n, dict) and "oneOf" in n for n in walked)
    for value in [{"v": 1}, {"v": 2, "w": "x"}, {"v": 2, "w": 3}, {"v": 3}, {}, {"v": 1, "w": 3}]:
        assert valid(hoisted, value) == valid(schema, value), value
        assert accepts(compiler, tokenizer, schema, value) == valid(schema, value), value
    assert with_reachable_ref_targets({"$ref": "#/$defs/x", "$defs": {"x": {"type": "string"}}}) == {
        "$ref": "#/$defs/x", "$defs": {"x": {"type": "string"}}}


def test_items_beside_a_small_max_items_are_negated_position_by_position(compiler, tokenizer):
    from loraplex.grammar.schema.negate import negate

    float3 = {"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 3, "additionalItems": False}
    negated = negate(float3, float3)
    assert negated is not None and "prefixItems" in str(negated)
    # without a bound, some item is not a number: a `contains` (which the array grammars enforce)
    unbounded = negate({"type": "array", "items": {"type": "number"}}, {})
    assert unbounded is not None and "contains" in str(unbounded) and "prefixItems" not in str(unbounded)
    values = [[1, 2, 3], [1, 2], [1, 2, "x"], ["x", 2, 3], [1, 2, 3, 4], [1, [2], 3], "s", None, [], {"a": 1}]
    for value in values:
        assert valid(negated, value) != valid(float3, value), value
    schema = {"type": "object", "properties": {"p": {"not": float3}}}
    for value in ({"p": [1, 2, 3]}, {"p": [1, "y", 3]}, {"p": [1]}, {"p": 7}, {}):
        assert accepts(compiler, tokenizer, schema, value) == valid(schema, value), value
