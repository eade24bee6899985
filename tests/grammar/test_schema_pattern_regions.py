"""Overlapping patternProperties written as disjoint regions: the same objects are valid (checked with
`jsonschema` over many keys), and llguidance's JSON compiler, which refused the overlap, enforces it."""

from __future__ import annotations

import json
import re
from itertools import product

import jsonschema
import pytest
from grammar_helpers import feed
from loraplex.grammar.schema.pattern_regions import (
    disjoint_pattern_properties,
    with_disjoint_pattern_properties,
)
from loraplex.grammar.spec import GrammarKind, GrammarSpec

_KEYS = ["".join(chars) for n in range(4) for chars in product("abx-", repeat=n)]

OVERLAPPING = [
    {"^a": {"type": "integer"}, "b$": {"minimum": 3}},
    {"^x-": {"type": "string"}, "^x-a$": {"maxLength": 1}, "b": False},
    {"a": {"type": "integer"}, "b": {"minimum": 2}, "^a?b?$": {"maximum": 5}},
]


@pytest.mark.parametrize("patterns", OVERLAPPING, ids=[json.dumps(p) for p in OVERLAPPING])
def test_regions_are_disjoint_and_keep_the_language(patterns):
    regions = disjoint_pattern_properties(patterns)
    assert regions is not None
    for key in _KEYS:
        inside = [r for r in regions if re.search(r, key)]
        assert len(inside) <= 1, key
        assert bool(inside) == any(re.search(p, key) for p in patterns), key
    schema = {"type": "object", "patternProperties": patterns, "additionalProperties": {"type": "boolean"}}
    split = {**schema, "patternProperties": regions}
    for key, value in product(_KEYS, [1, 4, 7, "s", True]):
        assert jsonschema.Draft7Validator(split).is_valid({key: value}) == jsonschema.Draft7Validator(
            schema).is_valid({key: value}), (key, value)


@pytest.mark.parametrize("patterns", [
    {"^a": {}, "^b": {}},                  # already disjoint
    {"^a": {}},                            # one pattern
    {"^a.": {}, "a": {}},                  # `.` is read differently by ECMA-262 and Python's re
    {r"^\d": {}, "1": {}},                 # so is \d
    {"(a)\\1": {}, "a": {}},               # a back-reference
    {"a": {}, "additionalProperties": {}},  # regions too long for llguidance to prove disjoint again
])
def test_what_is_left_as_it_is(patterns):
    assert disjoint_pattern_properties(patterns) is None


def test_the_pass_rewrites_nested_maps_and_leaves_the_input_alone():
    inner = {"type": "object", "patternProperties": {"^a": {"type": "integer"}, "b$": {"minimum": 3}}}
    schema = {"type": "object", "properties": {"p": inner}}
    out = with_disjoint_pattern_properties(schema)
    assert out["properties"]["p"]["patternProperties"] == disjoint_pattern_properties(inner["patternProperties"])
    assert schema["properties"]["p"] is inner and len(inner["patternProperties"]) == 2
    alone = {"type": "object", "patternProperties": {"^a": {}, "^b": {}}}
    assert with_disjoint_pattern_properties(alone) is alone


def test_compiled_through_the_backend(compiler, tokenizer):
    schema = {"type": "object", "properties": {"headers": {
        "type": "object", "patternProperties": {"^x-": {"type": "string"}, "^x-id$": {"pattern": "^[0-9]+$"},
                                                "-$": False},
        "additionalProperties": {"type": "integer"}}}, "required": ["headers"]}
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True))
    assert grammar.backend == "llguidance" and grammar.relaxed is None
    validator = jsonschema.Draft7Validator(schema)
    cases = [({"headers": {"x-a": "s", "x-id": "12", "n": 3}}, True), ({"headers": {}}, True),
             ({"headers": {"x-id": "1a"}}, False), ({"headers": {"x-a": 1}}, False),
             ({"headers": {"n": "s"}}, False), ({"headers": {"x-": "s"}}, False), ({"headers": {"a-": 1}}, False)]
    for value, expected in cases:
        assert validator.is_valid(value) == expected, value
        matcher, accepted = feed(grammar, tokenizer, json.dumps(value))
        assert (accepted and matcher.is_completed()) == expected, value
