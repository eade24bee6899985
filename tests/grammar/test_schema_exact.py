"""The exact schema rewrites: each keeps the language, checked with `jsonschema` over a grid of values,
and the rewritten schema compiles to a grammar that judges the same values the same way."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from loraplex.grammar.schema.negate import negate, strings_outside
from loraplex.grammar.schema.passes import prepare_schema
from loraplex.grammar.spec import GrammarKind, GrammarSpec

VALUES = [
    None, True, False, 0, 1, -3, 2.5, 7, 12, 25, 35, 100, "", "a", "ab", "abc", "linux", "lin", "linuxx", "x y",
    [], [1], [1, 2], ["a", "b", "c"], {}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2}, {"a": "s", "c": True},
    {"a": 1, "b": 2, "c": 3}, {"c": None}, {"c": True}, {"b": 2, "c": 3}, {"ab": 1}, {"a": 1, "ba": 2},
    {"xz": 1}, {"b": "s"}, {"a": 1, "b": [2]},
]

NEGATABLE = [
    {"type": "string"}, {"type": ["object", "null"]}, {"minimum": 7}, {"exclusiveMaximum": 12},
    {"minLength": 2}, {"maxItems": 1}, {"required": ["a", "b"]}, {"properties": {"a": {"type": "number"}}},
    {"enum": ["linux", "lin", 7, None, True]}, {"const": 25}, {"allOf": [{"minimum": 2}, {"maximum": 30}]},
    {"anyOf": [{"type": "string", "maxLength": 1}, {"required": ["c"]}]}, {"not": {"type": "number"}},
    {"type": "object", "properties": {"a": {"enum": [1, "s"]}}, "required": ["a"]}, {}, True, False,
    {"propertyNames": {"not": {"const": "a"}}}, {"propertyNames": {"not": {"enum": ["b", "c", 3]}}},
    {"additionalProperties": True, "items": {}, "patternProperties": {"^a": True}},
    # patterns matching a finite set of keys: one of those keys holds a value the subschema rejects
    {"patternProperties": {"^(a|b)$": {"type": "number"}, "^c$": True, "^[xy]z?$": False}},
    # a closed object: some key it does not declare is present
    {"properties": {"a": {"type": "number"}, "b": {}}, "additionalProperties": False},
    {"type": "object", "additionalProperties": False},
    # a pattern: the strings outside its regular language
    {"pattern": "^a"}, {"type": "string", "pattern": "b$"},
    # items without a small maxItems: some item fails (contains); contains: every item fails (items)
    {"items": {"type": "string"}}, {"type": "array", "contains": {"type": "number", "minimum": 5}},
    {"contains": {"enum": ["a", 1]}, "items": {"type": ["string", "number"]}},
]


def valid(schema, value) -> bool:
    return jsonschema.Draft7Validator(schema).is_valid(value)  # draft 7 still has `dependencies`


@pytest.mark.parametrize("schema", NEGATABLE, ids=[json.dumps(s) for s in NEGATABLE])
def test_negation_accepts_exactly_what_the_schema_rejects(schema):
    negated = negate(schema, schema)
    assert negated is not None
    for value in VALUES:
        assert valid(negated, value) != valid(schema, value), (negated, value)


@pytest.mark.parametrize("schema", [{"multipleOf": 3}, {"items": {"type": "integer"}},
                                    {"additionalProperties": {"type": "integer"}},
                                    {"patternProperties": {"^a": {"type": "integer"}}},
                                    {"type": "integer"}, {"enum": [[1]]}, {"uniqueItems": True}])
def test_what_cannot_be_negated_exactly_is_not_negated(schema):
    assert negate(schema, schema) is None


def test_strings_outside_a_finite_set():
    words = ["linux", "lin", "", "a]b", "é\\"]
    pattern = re.compile(strings_outside(words).replace("\\u", "\\u"))
    for text in [*words, "l", "li", "linu", "linuxx", "b", "a]", "a]bc", "é", "x"]:
        assert bool(pattern.fullmatch(text)) == (text not in words), text


REWRITTEN = [
    # an enum filtered by everything beside it (what a validator says, for any keyword)
    {"allOf": [{"enum": [1, 25, 35, "x", {"foo": 1}]}, {"not": {"not": {"allOf": [{"minimum": 20}, {"maximum": 30}]}}}]},
    {"type": "integer", "enum": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "multipleOf": 5, "if": {"maximum": 5},
     "then": {"minimum": 5}, "else": {"minimum": 9}},
    # not / if-then-else / dependencies / overlapping oneOf, rewritten into what backends enforce
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {}},
     "not": {"required": ["a", "b"]}},
    {"type": "object", "properties": {"a": {"type": "string"}, "c": {"type": "boolean"}},
     "if": {"properties": {"c": {"const": True}}, "required": ["c"]}, "then": {"required": ["a"]},
     "else": {"properties": {"a": {"maxLength": 1}}}},
    {"type": "object", "properties": {"a": {}, "b": {}, "c": {}}, "dependencies": {"a": ["b"], "c": {"required": ["a"]}}},
    {"type": "object", "properties": {"a": {}, "b": {}, "c": {}},
     "oneOf": [{"required": ["a"]}, {"required": ["b"]}, {"required": ["a", "c"]}]},
    {"oneOf": [{"enum": ["linux"]}, {"type": "string"}]},
    {"type": "object", "properties": {"a": {"not": {"type": ["string", "array"]}}}},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}, "minProperties": 1},
    {"type": "object", "properties": {"a": {}, "c": {}}, "additionalProperties": False, "minProperties": 1},
    # the key counts of a closed object, as the sets of keys allowed
    {"type": "object", "properties": {"a": {}, "b": {}, "c": {}}, "additionalProperties": False,
     "minProperties": 1, "maxProperties": 2},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}, "c": {}}, "additionalProperties": False,
     "minProperties": 2},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}, "required": ["a"],
     "additionalProperties": False, "maxProperties": 1},
    # "some key a or b is not a number", the complement of a patternProperties over a finite set of keys
    {"type": "object", "not": {"patternProperties": {"^(a|b)$": {"type": "number"}}}},
    # the key counts beside optional keys of an open object: one branch per set of them present
    {"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^[bc]$": {"type": "integer"}},
     "additionalProperties": False, "minProperties": 2},
    {"type": "object", "properties": {"a": {}, "b": {"type": "integer"}}, "maxProperties": 1},
    # propertyNames, as the keys it allows
    {"type": "object", "propertyNames": {"enum": ["a", "c"]}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "propertyNames": {"not": {"enum": ["b", "ab"]}},
     "additionalProperties": {"type": "boolean"}},
    {"type": "object", "propertyNames": {"pattern": "^[ab]$"}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"a": {"type": "integer"}, "c": {}}, "propertyNames": {"pattern": "^[ab]"}},
    # a oneOf whose branches share a conjunct (not negatable here) is that conjunct and a oneOf of the rest
    {"oneOf": [{"allOf": [{"$ref": "#/$defs/base"}, {"properties": {"b": {"const": 2}}}]},
               {"allOf": [{"$ref": "#/$defs/base"}, {"properties": {"b": {"const": 3}}}]}],
     "$defs": {"base": {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$"}}}}},
    # not a closed object: a key it does not declare
    {"type": "object", "not": {"properties": {"a": {}, "b": {}}, "additionalProperties": False}},
    # an object requiring a key it forbids accepts nothing
    {"anyOf": [{"type": "object", "properties": {"a": {}}, "required": ["b"], "additionalProperties": False},
               {"type": "string"}]},
]


@pytest.mark.parametrize("schema", REWRITTEN, ids=[json.dumps(s)[:60] for s in REWRITTEN])
def test_rewrites_keep_the_language_and_compile_exactly(compiler, tokenizer, schema):
    rewritten = prepare_schema(schema).schema
    text = json.dumps(rewritten)
    assert '"not"' not in text and '"if"' not in text and '"dependencies"' not in text and '"oneOf"' not in text
    for value in VALUES:
        assert valid(rewritten, value) == valid(schema, value), value
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True))
    assert grammar.backend == "llguidance" and grammar.relaxed is None
    for value in VALUES:
        matcher = grammar.new_matcher()
        ids = tokenizer.encode(json.dumps(value, ensure_ascii=False), add_special_tokens=False)
        accepted = all(matcher.accept_token(t) for t in ids) and matcher.is_completed()
        if not valid(schema, value):
            assert not accepted, value  # never looser than the schema
    assert prepare_schema(schema).schema == rewritten  # deterministic, and the input is left alone


def test_an_unsatisfiable_schema_is_a_clear_400(compiler):
    from loraplex.engine.errors import InvalidRequestError

    schema = {"allOf": [{"enum": [35]}, {"not": {"minimum": 20}}]}
    with pytest.raises(InvalidRequestError, match="accepts no JSON value"):
        compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, param="p", strict=True))


def test_draft7_ref_overrides_its_siblings(compiler, tokenizer):
    defs = {"p": {"type": ["string", "object"]}}
    later = {"type": "object", "properties": {"a": {"$ref": "#/definitions/p", "enum": ["key"]}}, "definitions": defs}
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", **later}
    for schema, zz_ok in ((draft7, True), (later, False)):
        grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True))
        for text, ok in (('{"a": "key"}', True), ('{"a": "zz"}', zz_ok), ('{"a": 3}', False)):
            assert jsonschema.validators.validator_for(schema)(schema).is_valid(json.loads(text)) == ok
            matcher = grammar.new_matcher()
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert (all(matcher.accept_token(t) for t in ids) and matcher.is_completed()) == ok, (schema, text)
