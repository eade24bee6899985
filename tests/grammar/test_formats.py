"""Strict mode enforces every format JSON Schema defines, or refuses it; a format no draft defines is an annotation.

The formats written as patterns are checked twice: the pattern by itself
(Python's `re`, the same regex) and the compiled grammar (llguidance), each
against instances chosen from their RFC grammars.
"""

from __future__ import annotations

import json
import re

import pytest
from grammar_helpers import feed
from loraplex.engine.errors import InvalidRequestError
from loraplex.grammar.schema.formats import FORMAT_PATTERNS, with_formats_enforced
from loraplex.grammar.spec import GrammarKind, GrammarSpec

INSTANCES: dict[str, tuple[list[str], list[str]]] = {
    "uri-template": (
        ["", "http://example.com/{id}", "{+path}/here", "{?x,y*}", "/a/{b:3}", "x%20y", "{a.b}", "{%41}", "{#x}"],
        ["{", "}", "{}", "{a b}", "{a:0}", "{a:10000}", "x y", "{a..b}", "http://ex.com/{", "%zz", "{a,}", "{a}}",
         "a'b", "a<b"],
    ),
    "json-pointer": (["", "/", "/a~0b", "/a~1b/0", "/ /x"], ["a", "/a~2", "/~", "#/a"]),
    "relative-json-pointer": (["0", "1/a", "0#", "10/b~0"], ["", "01", "-1", "/a", "0##", "a"]),
    "uri-reference": (
        ["", "http://a/b?c#d", "//host:80/p", "../x", "a/b:c", "#frag", "?q", "mailto:x@y", "http://[::1]/",
         "http://[v1.x]/", "http://u:p@h/", "urn:a:b"],
        ["http://a b", ":x", "http://[::1/", "a%2", "http://h/<>", "\\x", "http://[1:2:3:4:5:6:7:8:9]/", "a#b#c"],
    ),
    "iri": (["http://é.com/ü", "urn:isbn:0451450523", "http://a/b?q\ue000"], ["//x", "é:x", "http://a b", "/path"]),
    "iri-reference": (["/path", "ü", "#é", "http://é.com"], [" ", "a b", "%g0", "a#é#"]),
}


def strict(schema):
    return GrammarSpec(GrammarKind.JSON_SCHEMA, schema, param="response_format.json_schema.schema", strict=True)


def accepts(grammar, tokenizer, value) -> bool:
    matcher, accepted = feed(grammar, tokenizer, json.dumps(value, ensure_ascii=False))
    return accepted and matcher.is_completed()


def test_every_pattern_format_has_instances():
    assert set(INSTANCES) == set(FORMAT_PATTERNS)


@pytest.mark.parametrize("fmt", sorted(INSTANCES))
def test_format_pattern_accepts_exactly_its_rfc_grammar(fmt):
    pattern = re.compile(FORMAT_PATTERNS[fmt])
    good, bad = INSTANCES[fmt]
    assert [s for s in good if not pattern.search(s)] == []
    assert [s for s in bad if pattern.search(s)] == []


@pytest.mark.parametrize("fmt", sorted(INSTANCES))
def test_strict_grammar_enforces_the_format(compiler, tokenizer, fmt):
    grammar = compiler.compile_blocking(strict({"type": "string", "format": fmt}))
    good, bad = INSTANCES[fmt]
    assert [s for s in good if not accepts(grammar, tokenizer, s)] == []
    assert [s for s in bad if accepts(grammar, tokenizer, s)] == []


def test_a_format_beside_a_pattern_enforces_both(compiler, tokenizer):
    grammar = compiler.compile_blocking(strict({"type": "string", "format": "json-pointer", "pattern": "^/a"}))
    assert accepts(grammar, tokenizer, "/ab/c")
    assert not accepts(grammar, tokenizer, "/b")  # a pointer, not /a...
    assert not accepts(grammar, tokenizer, "/a~2")  # /a..., not a pointer


@pytest.mark.parametrize(("fmt", "path"), [("idn-email", "#/properties/e"), ("regex", "#/properties/e"),
                                           ("idn-hostname", "#/properties/e")])
def test_strict_refuses_a_defined_format_no_backend_enforces(compiler, fmt, path):
    schema = {"type": "object", "properties": {"e": {"type": "string", "format": fmt}}}
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile_blocking(strict(schema))
    assert f"keyword 'format: {fmt}' at {path}" in info.value.message
    assert info.value.param == "response_format.json_schema.schema"


def test_non_strict_relaxes_a_defined_format_and_says_so(compiler):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, {"type": "string", "format": "regex"}))
    assert "format: regex" in grammar.relaxed


def test_a_format_no_draft_defines_is_an_annotation(compiler, tokenizer):
    grammar = compiler.compile_blocking(strict({"type": "string", "format": "int32-ish"}))
    assert grammar.relaxed is None and accepts(grammar, tokenizer, "anything at all")


def test_format_pass_rewrites_only_what_it_must():
    schema = {"type": "object", "properties": {
        "t": {"type": "string", "format": "uri-template"},
        "d": {"type": "string", "format": "date-time"},
        "n": {"type": "integer", "format": "date"},
        "x": {"type": "string", "format": "textarea"},
        "p": {"type": "string", "format": "json-pointer", "pattern": "^/"},
    }}
    out = with_formats_enforced(schema)["properties"]
    assert out["t"] == {"type": "string", "pattern": FORMAT_PATTERNS["uri-template"]}
    assert out["d"] == {"type": "string", "format": "date-time"}  # the backend's own
    assert out["n"] == {"type": "integer"} and out["x"] == {"type": "string"}
    assert out["p"] == {"type": "string", "pattern": "^/", "allOf": [{"pattern": FORMAT_PATTERNS["json-pointer"]}]}
    assert schema["properties"]["t"]["format"] == "uri-template"  # the input is left alone


def test_draft3_formats_only_under_draft3():
    draft3 = {"$schema": "http://json-schema.org/draft-03/schema#", "type": "object", "properties": {
        "h": {"type": "string", "format": "host-name"}, "c": {"type": "string", "format": "color"},
        "m": {"type": "number", "format": "utc-millisec"}}}
    out = with_formats_enforced(draft3)["properties"]
    assert out["h"]["format"] == "hostname" and out["c"]["format"] == "color" and "format" not in out["m"]
    later = with_formats_enforced({"type": "string", "format": "color"})
    assert later == {"type": "string"}
