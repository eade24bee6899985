"""Patterns as regular languages: complements, intersections and lookaheads written as plain regexes.

Each result is checked against Python's `re` on every short string over an
alphabet the patterns care about (no line terminators there, where the
readings of `.`, `$` and `\\s` differ), then the strings the readings dispute
are checked to be left out, and the rewrites are compiled by the real
backend: valid values accepted, invalid ones refused.
"""

from __future__ import annotations

import json
import re
from itertools import product

import jsonschema
import pytest
from grammar_helpers import feed
from loraplex.grammar.schema.lookaheads import with_lookaheads_resolved, without_lookaheads
from loraplex.grammar.schema.negate import negate
from loraplex.grammar.schema.regular import Unregular
from loraplex.grammar.schema.regular_dfa import pattern_complement, patterns_region, plain_pattern
from loraplex.grammar.spec import GrammarKind, GrammarSpec

_STRINGS = ["".join(chars) for n in range(5) for chars in product("ab 9-@", repeat=n)]

PATTERNS = [
    r"^[0-4]?[0-9]{3}$", "a", "^a", "b$", r"^\s*$", "99", "", "^.*$", r"^(\w\w\d)+$", r"(^[^9]*$)|@",
    r"ab|^b", r"^a{2,3}$", r"[^a]b", r"^(a$|b)", r"a.b",
    # lookaheads, outside repetitions or inside bounded ones
    r"^(?!ab)[a-b]+$", r"^@([\da-z](?:(?!.*--)[\da-z-]*[\da-z])?)$", "a(?=b)", r"^(?=.*a)(?=.*b).*$",
    r"^[a-b]*(?!a)$", r"^(?:(?!a-)[a-b-]){0,3}$",
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_complement_and_plain_pattern_match_as_the_pattern_says(pattern):
    outside, plain = pattern_complement(pattern), plain_pattern(pattern)
    for s in _STRINGS:
        matches = re.search(pattern, s) is not None
        assert bool(outside and re.search(outside, s)) == (not matches), (outside, s)
        assert bool(plain and re.search(plain, s)) == matches, (plain, s)
    for result in (outside, plain):
        assert result is None or (result.startswith("^") and result.endswith("$") and "(?=" not in result
                                  and "(?!" not in result)


def test_an_empty_language_is_none():
    assert pattern_complement("") is None and pattern_complement(r"^[\s\S]*$") is None
    assert plain_pattern("a(?!)") is None


def test_strings_the_readings_dispute_are_left_out():
    # `$` before a final newline (Python), \d beyond ASCII (Python), `.` at a carriage return (Python)
    assert re.search(r"^\d+$", "1\n") and not re.search(pattern_complement(r"^\d+$"), "1\n")
    assert re.search(r"^\d+$", "\u0663") and not re.search(pattern_complement(r"^\d+$"), "\u0663")
    assert not re.search(pattern_complement(r"^a.b$"), "a\rb") and not re.search(plain_pattern(r"^a.b$"), "a\rb")
    assert re.search(pattern_complement(r"^\d+$"), "1a")


def test_region_of_several_patterns():
    region = patterns_region(["a", "b"], ["9"])
    for s in _STRINGS:
        assert bool(re.search(region, s)) == ("a" in s and "b" in s and "9" not in s), s


@pytest.mark.parametrize("pattern", [r"(?<=a)b", r"(a)\1", r"^(?:a|b(?!c))*$", r"(?i)a", r"\bab", "["])
def test_what_is_not_read_as_a_regular_language(pattern):
    with pytest.raises(Unregular):
        plain_pattern(pattern)
    assert without_lookaheads(pattern) is None


@pytest.mark.parametrize("pattern", ["^" + "a?" * 500 + "b$", "^(a|b)*a(a|b){12}$", "a" * 2000])
def test_a_pattern_too_large_to_write_is_refused_not_a_crash(pattern):
    with pytest.raises(Unregular):
        pattern_complement(pattern)


def test_negated_pattern_is_the_strings_outside_and_every_other_type():
    schema = {"pattern": r"^[0-4]?[0-9]{3}$"}
    negated = negate(schema, schema)
    assert negated is not None and negated["type"] == "string"
    for value in ["123", "1234", "5123", "12", "a123", "", 7, None, ["123"]]:
        assert jsonschema.Draft7Validator(negated).is_valid(value) != jsonschema.Draft7Validator(schema).is_valid(
            value) or not isinstance(value, str), value
    assert negate({"pattern": ""}, {}) is False  # every string matches: none fails it


def test_the_lookahead_pass_rewrites_patterns_and_keys_and_leaves_the_input_alone():
    name = r"^(?!.*--)[a-z-]+$"
    schema = {"type": "object", "properties": {"n": {"type": "string", "pattern": name}},
              "patternProperties": {"^(?!x)": {"type": "integer"}, "^y": {}}}
    out = with_lookaheads_resolved(schema)
    assert out["properties"]["n"]["pattern"] == plain_pattern(name)
    assert set(out["patternProperties"]) == {plain_pattern("^(?!x)"), "^y"}
    assert schema["properties"]["n"]["pattern"] == name
    plain = {"type": "string", "pattern": "^a$"}
    assert with_lookaheads_resolved(plain) is plain


CASES = [
    # a lookahead inside an object's property: llguidance refused the pattern before
    ({"type": "object", "properties": {"name": {"type": "string", "pattern": r"^@[a-z](?:(?!.*--)[a-z-]*[a-z])?$"}},
      "required": ["name"], "additionalProperties": False},
     [{"name": "@a"}, {"name": "@ab-c"}, {"name": "@a-b-c"}],
     [{"name": "@a--b"}, {"name": "@a-"}, {"name": "a"}, {"name": "@"}]),
    # `not` of a pattern beside other keywords, inside an object
    ({"type": "object", "properties": {"mode": {"type": "string", "not": {"pattern": "^[0-7]{3}$"}},
                                       "n": {"type": "integer"}}, "required": ["mode"]},
     [{"mode": "abc"}, {"mode": "1234"}, {"mode": "78"}, {"mode": "", "n": 1}],
     [{"mode": "644"}, {"mode": "777"}, {"mode": 644}, {"mode": "644", "n": 1}]),
    # if/then/else whose condition is a pattern: its complement is needed for the else branch
    ({"type": "object", "properties": {"id": {"type": "string", "if": {"pattern": "^x"},
                                              "then": {"maxLength": 3}, "else": {"minLength": 2}}}},
     [{"id": "xab"}, {"id": "ab"}, {}], [{"id": "xabc"}, {"id": "a"}]),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), CASES, ids=["lookahead", "not-pattern", "if-pattern"])
def test_compiled_through_the_backend(compiler, tokenizer, schema, valid, invalid):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True))
    assert grammar.backend == "llguidance" and grammar.relaxed is None
    validator = jsonschema.Draft202012Validator(schema)
    for values, expected in ((valid, True), (invalid, False)):
        for value in values:
            assert validator.is_valid(value) == expected, value
            matcher, accepted = feed(grammar, tokenizer, json.dumps(value))
            assert (accepted and matcher.is_completed()) == expected, value
