"""String-only schemas as one Lark terminal (`&`, `|`, `~`): the grammar accepts exactly the strings
`jsonschema` accepts, every character in the form our JSON text gives it (escapes included)."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest
from grammar_helpers import feed
from loraplex.grammar.backends.llguidance_backend import _limits
from loraplex.grammar.backends.string_lark import string_schema_lark
from loraplex.grammar.spec import GrammarKind, GrammarSpec

SCHEMAS = [
    {"type": "string", "allOf": [{"pattern": "a"}, {"not": {"pattern": "b"}}], "maxLength": 6},
    {"type": "string", "oneOf": [{"pattern": "^x"}, {"pattern": "y$"}]},
    {"type": "string", "if": {"pattern": "^a"}, "then": {"minLength": 3}, "else": {"not": {"pattern": "[0-9]"}}},
    {"type": "string", "not": {"anyOf": [{"pattern": "^[a-z]*$"}, {"enum": ['A"B', "Q", 3]}]}},
    {"type": "string", "pattern": "^.[.\\\\/\"][^a]$"},
    {"type": "string", "anyOf": [{"$ref": "#/$defs/w"}, {"const": "\t"}], "$defs": {"w": {"pattern": "^\\w+\\s\\w$"}}},
]
VALUES = ["", "a", "ab", "ba", "xay", "x", "y", "xy", "a1", "b2", "abc", 'A"B', "Q", "a\nb", "\\", "/", "é", "\u0001",
          "a.b", "a\u2028b", "x\ty", "aaaaaaa", "q/z", 'q"z', "q\\z", "q\\a", "ab c", "ab\tc", "\t", "a\u00a0b", "zz\x1f"]


def valid(schema, value) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def lark_accepts(matcher, tokenizer, value) -> bool:
    probe = matcher.deep_copy()
    ids = tokenizer.encode(json.dumps(value, ensure_ascii=False), add_special_tokens=False)
    return probe.validate_tokens(ids) == len(ids) and probe.consume_tokens(ids) and probe.is_accepting()


@pytest.mark.parametrize("schema", SCHEMAS, ids=[json.dumps(s)[:60] for s in SCHEMAS])
def test_the_terminal_accepts_exactly_the_schemas_strings(compiler, tokenizer, schema):
    lark = string_schema_lark(schema)
    assert lark is not None
    backend = compiler.backends["llguidance"]
    matcher = llguidance.LLMatcher(backend.tokenizer, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0,
                                   limits=_limits())
    assert not matcher.is_error(), matcher.get_error()
    assert any(valid(schema, v) for v in VALUES) and any(not valid(schema, v) for v in VALUES)
    for value in VALUES:
        assert lark_accepts(matcher, tokenizer, value) == valid(schema, value), value
    assert not lark_accepts(matcher, tokenizer, 3)


@pytest.mark.parametrize("schema", [
    {"type": ["string", "null"], "pattern": "a"},       # not string-only
    {"type": "string", "pattern": "(?=a)b"},            # lookahead
    {"type": "string", "pattern": "a\\b"},              # word boundary
    {"type": "string", "pattern": "^a|b$"},             # an anchor inside an alternative
    {"type": "string", "format": "email", "not": {"pattern": "x"}},
])
def test_what_the_terminal_cannot_say_is_left_alone(schema):
    assert string_schema_lark(schema) is None


def test_a_string_schema_the_json_compiler_refuses_compiles_through_the_terminal(compiler, tokenizer):
    schema = {"type": "string", "pattern": "^[a-z]+$", "not": {"pattern": "ab"}, "maxLength": 8}
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True))
    assert grammar.backend == "llguidance" and grammar.relaxed is None
    for value in ("xyz", "ba", "abc", "xab", "Abc", "abcdefghi", "", 5):
        matcher, ok = feed(grammar, tokenizer, json.dumps(value))
        assert (ok and matcher.is_completed()) == valid(schema, value), value
