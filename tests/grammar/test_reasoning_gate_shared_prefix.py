"""The think marker and the answer's grammar may begin with the same token (`<think>` / `<tool_call>`: `<`).

The gate must not commit to thinking on that token: both paths stay open until
they differ, and a completed marker hands the answer a fresh matcher.
"""

from __future__ import annotations

import json

from loraplex.grammar.runtime.reasoning_gate import ReasoningGatedGrammar
from loraplex.grammar.spec import GrammarKind, GrammarSpec
from loraplex.platform.reasoning_parser import ReasoningFormat, reasoning_markers
from test_reasoning_gate import allowed, ids


def tagged_grammar(compiler, tokenizer):
    """Answers of the form `<tool>{json}` -- the same first token as `<think>`."""
    markers = reasoning_markers(tokenizer, ReasoningFormat())
    lark = 'root ::= "<tool>" "{\\"ok\\": " ("true" | "false") "}"'
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.EBNF, lark))
    return ReasoningGatedGrammar(grammar, markers), markers


def test_shared_first_token_can_still_become_the_answer(compiler, tokenizer):
    grammar, markers = tagged_grammar(compiler, tokenizer)
    answer = ids(tokenizer, "<tool>" + json.dumps({"ok": True}))
    assert answer[0] == markers.start_token_ids[0]  # the case under test
    matcher = grammar.new_matcher()
    for token in answer:
        assert matcher.accept_token(token), tokenizer.decode([token])
    assert matcher.is_terminated()


def test_shared_first_token_can_still_open_the_think_block(compiler, tokenizer):
    grammar, markers = tagged_grammar(compiler, tokenizer)
    matcher = grammar.new_matcher()
    assert matcher.accept_token(markers.start_token_ids[0])
    assert allowed(matcher, markers.start_token_ids[1]) and allowed(matcher, ids(tokenizer, "<tool>")[1])
    assert not allowed(matcher, ids(tokenizer, "Hello")[0])
    for token in markers.start_token_ids[1:] + ids(tokenizer, "free thoughts") + markers.end_token_ids:
        assert matcher.accept_token(token)
    # The answer starts from the beginning of its grammar, untouched by the marker's tokens.
    for token in ids(tokenizer, "<tool>" + json.dumps({"ok": False})):
        assert matcher.accept_token(token), tokenizer.decode([token])
    assert matcher.is_terminated()
