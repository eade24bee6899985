"""A `$` inside a pattern, written without it: the rewritten pattern matches exactly the strings the original
does (under ECMA-262's `$`, the very end), and llguidance compiles what it refused before."""

from __future__ import annotations

import re
from itertools import product

import pytest
from grammar_helpers import feed
from loraplex.grammar.schema.anchors import with_inner_end_anchors_resolved, without_inner_end_anchors
from loraplex.grammar.spec import GrammarKind, GrammarSpec

# Every string of up to 4 characters over an alphabet the patterns below care about (no newline: there
# Python's `$` and ECMA-262's agree, so `re.search` is the original's meaning).
_STRINGS = ["".join(chars) for n in range(5) for chars in product("a/.x-", repeat=n)]

INNER_ANCHORS = [
    r"^(\/?((\.{2})|([a-z0-9\-]*))($|\/))*$",  # a path: each segment ends at a slash or at the end
    r"x($|a)+",
    r"(a$|x)/",
    r"^(a|\.$){2,3}",
    r"(?:a$|/)?x",
    r"^[^/]+(/|$)x?",
]


@pytest.mark.parametrize("pattern", INNER_ANCHORS)
def test_the_rewritten_pattern_matches_the_same_strings(pattern):
    rewritten = without_inner_end_anchors(pattern)
    assert rewritten is not None and rewritten.startswith("^") and rewritten.endswith("$")
    inner = rewritten[1:-1]
    assert "$" not in inner  # no anchor left but the closing one
    differ = [s for s in _STRINGS if bool(re.search(pattern, s)) != bool(re.fullmatch(inner, s))]
    assert differ == []


@pytest.mark.parametrize("pattern", [
    r"^a$", r"a|b$", r"^(a|b$)", r"(a$|b)",  # `$` only at the tail, where backends take it
    r"(?=a)b($|c)", r"(a)\1($|b)",   # lookarounds and back-references are left alone
    r"(^a$|b)c", r"(?i)a($|b)c",     # a `^` inside, a global flag
    r"a\Z(b|$)",                     # `\Z` is the letter Z in ECMA-262
    r"[",                            # not a regex
])
def test_what_is_left_as_it_is(pattern):
    assert without_inner_end_anchors(pattern) is None


def test_the_pass_rewrites_patterns_wherever_they_are_and_leaves_the_input_alone():
    path = r"^(a($|/))*$"
    schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": path}},
              "definitions": {"d": {"pattern": path}}, "patternProperties": {"x": {"pattern": "^b$"}}}
    rewritten = with_inner_end_anchors_resolved(schema)
    assert rewritten["properties"]["p"]["pattern"] == without_inner_end_anchors(path)
    assert rewritten["definitions"]["d"]["pattern"] == without_inner_end_anchors(path)
    assert rewritten["patternProperties"]["x"]["pattern"] == "^b$"
    assert schema["properties"]["p"]["pattern"] == path
    plain = {"type": "string", "pattern": "^a$"}
    assert with_inner_end_anchors_resolved(plain) is plain


def test_a_path_pattern_compiles_and_is_enforced(compiler, tokenizer):
    schema = {"type": "string", "pattern": r"^(\/?((\.{2})|([a-z0-9\-]*))($|\/))*$"}
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True))
    for text, valid in [('"/usr/lib"', True), ('"../a-b/"', True), ('""', True), ('"/A"', False),
                        ('"a/./b"', False)]:
        matcher, accepted = feed(grammar, tokenizer, text)
        assert (accepted and matcher.is_completed()) == valid, text
