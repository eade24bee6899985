"""Integer-only schemas with complements of `multipleOf` as a Lark grammar of the digits: the grammar accepts
exactly the integers `jsonschema` accepts (negative, zero, around every bound, past it by residue), and refuses
every other text; schemas it cannot read so are left to the JSON compiler."""

from __future__ import annotations

import json

import pytest
from grammar_helpers import assert_strict_grammar_enforces_exactly, feed
from loraplex.engine.errors import InvalidRequestError
from loraplex.grammar.backends.integer_lark import integer_lark
from loraplex.grammar.spec import GrammarKind, GrammarSpec

SCHEMAS = [
    # not a multiple of 3
    {"type": "integer", "not": {"multipleOf": 3}},
    # a number that is a multiple of 3, 5 or 7 but not of 8, at least 1 (numbers: fractions fail every multipleOf)
    {"type": "number", "allOf": [{"minimum": 1}, {"anyOf": [{"multipleOf": 3}, {"multipleOf": 5}, {"multipleOf": 7}]},
                                 {"not": {"multipleOf": 8}}]},
    # exactly one of: a multiple of 4, a multiple of 6 (overlapping oneOf)
    {"type": "integer", "oneOf": [{"multipleOf": 4}, {"multipleOf": 6}]},
    # multiples of 10 in (-100, 250], except three listed ones, through a $ref
    {"$ref": "#/$defs/a", "$defs": {"a": {"type": "integer", "multipleOf": 10, "exclusiveMinimum": -100,
                                          "maximum": 250, "not": {"enum": [0, 30, 240]}}}},
    # if a multiple of 5 then a multiple of 2, else odd; and not 1
    {"type": "integer", "if": {"multipleOf": 5}, "then": {"multipleOf": 2}, "else": {"not": {"multipleOf": 2}},
     "not": {"const": 1}},
]
INTEGERS = [*range(-130, 131), *range(235, 265), 999, 1000, 1001, 12345, 123456789, -987654321]
OTHER_TEXTS = ["1.5", "-0", "007", "1e3", "+5", "\"6\"", "null", "[]", "--3", "3-"]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[json.dumps(s)[:60] for s in SCHEMAS])
def test_integers_are_enforced_exactly(compiler, tokenizer, schema):
    grammar = assert_strict_grammar_enforces_exactly(compiler, tokenizer, schema, INTEGERS)
    for text in OTHER_TEXTS:
        matcher, ok = feed(grammar, tokenizer, text)
        assert not (ok and matcher.is_completed()), text


@pytest.mark.parametrize("schema", [
    {"not": {"multipleOf": 3}},                                     # other types pass it
    {"type": "number", "not": {"multipleOf": 3}},                   # 1.5 passes it: not integers only
    {"type": "integer", "not": {"multipleOf": 2.5}},                # a fractional step
    {"type": "integer", "not": {"multipleOf": 3}, "maximum": 1e9},  # a bound too far to count to
    {"type": "integer", "not": {"multipleOf": 7919}},               # too many residues to write
    {"type": "integer", "not": {"$dynamicRef": "#a"}},
])
def test_what_is_left_alone(schema):
    assert integer_lark(schema) is None


def test_a_schema_no_integer_meets_is_refused(compiler):
    schema = {"type": "integer", "multipleOf": 4, "not": {"multipleOf": 2}}
    with pytest.raises(InvalidRequestError):
        compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True))
