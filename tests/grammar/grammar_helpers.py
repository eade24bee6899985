"""Helpers shared by the grammar tests (imported by name: test folders are not packages)."""

from __future__ import annotations

import json

SMOLLM2_VOCAB = 49152


def feed(grammar, tokenizer, text: str):
    """A fresh matcher fed `text`'s tokens; returns (matcher, all tokens accepted)."""
    matcher = grammar.new_matcher()
    accepted = all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    return matcher, accepted


def assert_strict_grammar_enforces_exactly(compiler, tokenizer, schema, values):
    """`schema` compiles in strict mode to an llguidance grammar (not relaxed) that accepts exactly the `values`
    `jsonschema` accepts, printed as JSON; the values must include some of each."""
    import jsonschema
    from loraplex.grammar.spec import GrammarKind, GrammarSpec

    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True))
    assert grammar.backend == "llguidance" and grammar.relaxed is None
    validator = jsonschema.Draft202012Validator(schema)
    judged = [validator.is_valid(v) for v in values]
    assert any(judged) and not all(judged)
    for value, expected in zip(values, judged, strict=True):
        matcher, ok = feed(grammar, tokenizer, json.dumps(value))
        assert (ok and matcher.is_completed()) == expected, value
    return grammar
