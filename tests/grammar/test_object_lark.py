"""Objects as a Lark grammar (the key one terminal, the value embedded JSON schema): the grammar accepts
exactly the objects `jsonschema` accepts, with two keys at most or more."""

from __future__ import annotations

import json

import jsonschema
import pytest
from grammar_helpers import feed
from loraplex.grammar.backends.object_lark import object_lark
from loraplex.grammar.spec import GrammarKind, GrammarSpec

SCHEMAS = [
    # some key holds "a", some key holds "b" and has an integer: with one key, that key does both
    {"type": "object", "maxProperties": 1, "minProperties": 1, "propertyNames": {"pattern": "^...$"},
     "allOf": [{"not": {"propertyNames": {"not": {"pattern": "a"}}}},
               {"not": {"patternProperties": {"b": {"not": {"type": "integer"}}}}}]},
    # empty, or one key starting with x holding a string, or "k" holding a number
    {"type": "object", "maxProperties": 1, "anyOf": [
        {"patternProperties": {"^x": {"type": "string"}}, "additionalProperties": False},
        {"properties": {"k": {"type": "number"}}, "additionalProperties": False}]},
    # regions of the key space: keys with "a" owe a string, keys ending in "z" a short one, the rest null
    {"type": "object", "maxProperties": 1, "patternProperties": {"a": {"type": "string"}, "z$": {"maxLength": 2}},
     "additionalProperties": {"type": "null"}, "required": ["abz"]},
    # two members: "k" holding an integer, and some key starting with x (holding a string), in either order
    {"type": "object", "maxProperties": 2, "required": ["k"], "not": {"propertyNames": {"not": {"pattern": "^x"}}},
     "properties": {"k": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
    # up to three two-letter keys: some key with "a" holds a string with "A", some key with "b" an integer
    {"type": "object", "maxProperties": 3, "minProperties": 1, "propertyNames": {"pattern": "^..$"},
     "allOf": [{"not": {"patternProperties": {"a": {"not": {"type": "string", "pattern": "A"}}}}},
               {"not": {"patternProperties": {"b": {"not": {"type": "integer"}}}}}]},
    # any number of keys, integers all, some key with "a"
    {"type": "object", "not": {"propertyNames": {"not": {"pattern": "a"}}}, "additionalProperties": {"type": "integer"}},
    # the same through a $ref at the root, at most three keys, strings all, some key starting with x
    {"$ref": "#/$defs/o", "$defs": {"o": {"type": "object", "maxProperties": 3, "additionalProperties": {"type": "string"},
                                          "not": {"propertyNames": {"not": {"pattern": "^x"}}}}}},
]
VALUES = [{}, {"abc": 1}, {"bac": "s"}, {"bac": 1}, {"ab": 1}, {"xab": 1}, {"x": "s"}, {"xa": "s"}, {"k": 2},
          {"k": "s"}, {"xk": "s"}, {"a": 1, "b": 2}, {"abz": "st"}, {"abz": "str"}, {"abz": None}, {"q": None},
          {"qz": None}, {"az": "s"}, {'a"b': 3}, {"a\\b": 3}, [], "abc", 3, {"k": 1, "xa": "s"}, {"xa": "s", "k": 1},
          {"k": 1, "xa": 2}, {"k": "s", "xa": "s"}, {"k": 1, "xa": "s", "xb": "t"}, {"k": 1, "q": "s"},
          {"ab": "A"}, {"ab": "AB"}, {"ab": 1}, {"xa": "A", "xb": 2}, {"xb": 2, "xa": "A"}, {"xa": "x", "xb": 2},
          {"qq": 1, "xa": "A", "xb": 2}, {"qq": 1, "xb": 2, "rr": 3, "xa": "A"}, {"xa": "A", "bq": 3, "qq": "s"},
          {"q": 1, "r": 2, "sa": 3}, {"q": 1, "r": 2, "s": 3}, {"sa": 3, "q": "x"}]


def valid(schema, value) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


@pytest.mark.parametrize("schema", SCHEMAS, ids=[json.dumps(s)[:60] for s in SCHEMAS])
def test_objects_are_enforced_exactly(compiler, tokenizer, schema):
    assert object_lark(schema) is not None
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True))
    assert grammar.backend == "llguidance" and grammar.relaxed is None
    assert any(valid(schema, v) for v in VALUES) and any(not valid(schema, v) for v in VALUES)
    for value in VALUES:
        matcher, ok = feed(grammar, tokenizer, json.dumps(value, ensure_ascii=False))
        assert (ok and matcher.is_completed()) == valid(schema, value), value


@pytest.mark.parametrize("schema", [
    {"type": "object", "maxProperties": 600, "not": {"propertyNames": {"not": {"pattern": "a"}}}},  # too many states
    {"type": "object", "maxProperties": 1, "properties": {"a": {"type": "string"}}, "minItems": 2, "items": False},
    {"type": ["object", "null"], "maxProperties": 1},
])
def test_objects_with_too_many_states_or_other_keywords_are_left_alone(schema):
    assert object_lark(schema) is None


# Values that llguidance's JSON compiler refuses, below the root: written as objects of their own, as rules
# (a value that recurs through $ref names its rule again); the other types as JSON where they meet the value.
NESTED = [
    # "tags" must hold some key starting with x- (a `not` of propertyNames: no other type meets it)
    ({"type": "object", "properties": {"tags": {"type": "object", "not": {"propertyNames": {"not": {"pattern": "^x-"}}}}},
      "required": ["tags"]},
     [{"tags": {"x-a": 1}}, {"tags": {"y": 1, "x-": 2}}, {"tags": {"x-a": 1}, "other": 2}],
     [{"tags": {}}, {"tags": {"y": 1}}, {"tags": 3}, {}, {"tags": "x-a"}]),
    # overlapping patterns (`.`: left overlapping by the regions pass), no type: any non-object meets them
    ({"type": "object", "properties": {"p": {"patternProperties": {"^x.": {"type": "integer"}, "y$": {"minimum": 0}}}}},
     [{"p": 5}, {"p": "s"}, {"p": {"xay": 3}}, {"p": {"zy": 2.5}}, {}, {"p": {"xa": -1}}],
     [{"p": {"xay": -1}}, {"p": {"xa": 1.5}}, {"p": {"zy": -2}}, {"p": {"xb": "s"}}]),
    # a recursive node: each one holds some key starting with "id", and its child is a node
    ({"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}},
                                                 "not": {"propertyNames": {"not": {"pattern": "^id"}}}}}},
     [{"id": 1}, {"idx": 1, "child": {"id": 2}}, {"id": 1, "child": {"id": 1, "child": {"id": 3}}}],
     [{"child": {"id": 1}}, {"id": 1, "child": {}}, {"id": 1, "child": {"id": 1, "child": {"x": 1}}},
      {"id": 1, "child": 3}]),
]


@pytest.mark.parametrize(("schema", "good", "bad"), NESTED, ids=["exists-below-root", "overlap-no-type", "recursive"])
def test_values_only_a_lark_grammar_says_are_written_as_rules(compiler, tokenizer, schema, good, bad):
    assert object_lark(schema) is not None
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True))
    assert grammar.backend == "llguidance" and grammar.relaxed is None
    for values, expected in ((good, True), (bad, False)):
        for value in values:
            assert valid(schema, value) == expected, value
            matcher, ok = feed(grammar, tokenizer, json.dumps(value, ensure_ascii=False))
            assert (ok and matcher.is_completed()) == expected, value


def test_conditions_on_the_same_keys_are_one():
    # five allOf members on the keys with "a" (five regions' worth before): one condition owing all five values
    schema = {"type": "object", "maxProperties": 1, "not": {"propertyNames": {"not": {"pattern": "b"}}},
              "allOf": [{"patternProperties": {"a": {"type": "integer", "minimum": i}}} for i in range(5)]
              + [{"patternProperties": {"c": {"maximum": 9}}}]}
    assert object_lark(schema) is not None
