from __future__ import annotations

import json

import torch
from grammar_helpers import SMOLLM2_VOCAB
from loraplex.engine.protocol import ReasoningMarkers
from loraplex.grammar.runtime.reasoning_gate import ReasoningGatedGrammar
from loraplex.grammar.spec import GrammarKind, GrammarSpec
from loraplex.platform.reasoning_parser import ReasoningFormat, reasoning_markers

WORDS = (SMOLLM2_VOCAB + 31) // 32
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def allowed(matcher, token_id: int) -> bool:
    bitmask = torch.zeros((1, WORDS), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    return bool((int(bitmask[0, token_id // 32]) >> (token_id % 32)) & 1)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def gated(compiler, tokenizer, starts_inside: bool = False):
    markers = reasoning_markers(tokenizer, ReasoningFormat())
    markers.starts_inside = starts_inside
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA))
    return ReasoningGatedGrammar(grammar, markers), markers


def test_think_freely_then_answer_in_json(compiler, tokenizer):
    grammar, markers = gated(compiler, tokenizer)
    matcher = grammar.new_matcher()
    brace = grammar.inner.new_matcher().forced_token_ids()[0]  # the answer's forced opening, as one token
    assert tokenizer.decode([brace]).startswith("{")
    assert allowed(matcher, markers.start_token_ids[0]) and allowed(matcher, brace)
    assert not allowed(matcher, ids(tokenizer, "Hello")[0])
    for token in markers.start_token_ids + ids(tokenizer, "Let me think: the user is fine. "):
        assert matcher.accept_token(token)
    assert allowed(matcher, ids(tokenizer, "Hello")[0])           # free text inside the block
    assert not allowed(matcher, tokenizer.eos_token_id)            # but no stopping before the answer
    for token in markers.end_token_ids:
        assert matcher.accept_token(token)
    assert not allowed(matcher, ids(tokenizer, "Hello")[0])       # the answer is constrained
    for token in ids(tokenizer, json.dumps({"ok": True})):
        assert matcher.accept_token(token)
    assert matcher.is_terminated()


def test_answer_without_thinking_goes_straight_to_the_grammar(compiler, tokenizer):
    grammar, _ = gated(compiler, tokenizer)
    matcher = grammar.new_matcher()
    for token in ids(tokenizer, '{"ok": false}'):
        assert matcher.accept_token(token)
    assert matcher.is_terminated()


def test_template_that_opens_the_block(compiler, tokenizer):
    grammar, markers = gated(compiler, tokenizer, starts_inside=True)
    matcher = grammar.new_matcher()
    assert allowed(matcher, ids(tokenizer, "Hmm")[0])
    for token in ids(tokenizer, "Hmm.") + markers.end_token_ids + ids(tokenizer, '{"ok": true}'):
        assert matcher.accept_token(token)
    assert matcher.is_terminated()


def test_no_markers_is_the_plain_grammar(compiler, tokenizer):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA))
    matcher = ReasoningGatedGrammar(grammar, ReasoningMarkers([], [])).new_matcher()
    assert not allowed(matcher, ids(tokenizer, "Hello")[0])
