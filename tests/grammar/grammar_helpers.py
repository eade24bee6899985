"""Helpers shared by the grammar tests (imported by name: test folders are not packages)."""

from __future__ import annotations

SMOLLM2_VOCAB = 49152


def feed(grammar, tokenizer, text: str):
    """A fresh matcher fed `text`'s tokens; returns (matcher, all tokens accepted)."""
    matcher = grammar.new_matcher()
    accepted = all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    return matcher, accepted
