"""Arrays with `contains` as a Lark grammar (items one after another, each embedded JSON schema): the grammar
accepts exactly the arrays `jsonschema` accepts, and the complement of `items` (a `contains`) compiles."""

from __future__ import annotations

import json
from itertools import product

import pytest
from grammar_helpers import assert_strict_grammar_enforces_exactly
from loraplex.grammar.backends.array_lark import array_lark

SCHEMAS = [
    # some item is an integer of at least 5
    {"type": "array", "contains": {"type": "integer", "minimum": 5}},
    # two or three integers or strings, some of them a string
    {"type": "array", "items": {"type": ["integer", "string"]}, "contains": {"type": "string"}, "minItems": 2,
     "maxItems": 3},
    # a 1 and a 2 somewhere, in either order (one item cannot be both)
    {"type": "array", "allOf": [{"contains": {"const": 1}}, {"contains": {"const": 2}}]},
    # exactly one of: every item has "a", every item has "a" or "b" (the oneOf needs the complement of items)
    {"oneOf": [{"items": {"pattern": "a"}}, {"items": {"pattern": "a|b"}}], "minItems": 1},
    # not every item is a string: some item is not one
    {"type": "array", "not": {"items": {"type": "string"}}},
    # through a $ref, either branch of an anyOf
    {"$ref": "#/$defs/a", "$defs": {"a": {"type": "array", "anyOf": [{"contains": {"const": "x"}},
                                                                      {"minItems": 3, "items": {"type": "null"}}]}}},
]
_ATOMS = [1, 2, 7, "a", "b", "ab", "x", None]
VALUES = [[], "a", 3, {"a": 1}, *([list(c) for n in range(1, 4) for c in product(_ATOMS, repeat=n)])]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[json.dumps(s)[:60] for s in SCHEMAS])
def test_arrays_are_enforced_exactly(compiler, tokenizer, schema):
    assert_strict_grammar_enforces_exactly(compiler, tokenizer, schema, VALUES)


@pytest.mark.parametrize("schema", [
    {"contains": {"const": 1}},                                        # other types pass it: not arrays only
    {"type": "array", "contains": {"const": 1}, "minContains": 2},     # counted contains
    {"type": "array", "contains": {"const": 1}, "uniqueItems": True},
    {"type": "array", "contains": {"const": 1}, "prefixItems": [{"type": "integer"}]},
    {"type": "array", "items": {"type": "integer"}},                   # no contains: the JSON compiler's
    {"type": "array", "contains": {"type": "array", "contains": {"const": 1}}},  # an item the JSON compiler refuses
])
def test_what_is_left_alone(schema):
    assert array_lark(schema) is None
