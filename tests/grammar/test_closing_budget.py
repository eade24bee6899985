"""JSON that closes, checked on the matcher with a hostile sampler instead of a model.

The sampler picks any token the mask allows (often the rarest ones: half-written
characters, time-zone offsets, a second tool call), so every way the budget can
run out is tried without a forward pass. Whatever it picks, a choice whose budget
allows any valid completion must end complete.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from grammar_helpers import feed
from loraplex.grammar.runtime.closing import plan_completion
from loraplex.grammar.spec import GrammarKind, GrammarSpec
from loraplex.grammar.tools import tool_call_spec
from loraplex.grammar.validation import parse_tools
from schema_suite import CASES

# An event as the openai SDK sends a Pydantic model (every property required, one nullable).
EVENT = {
    "type": "object", "additionalProperties": False,
    "properties": {"name": {"type": "string"}, "date": {"type": "string"}, "participants": {"type": "array", "items": {"type": "string"}},
                   "kind": {"enum": ["meeting", "party", "other"], "type": "string"},
                   "priority": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
    "required": ["name", "date", "participants", "kind", "priority"],
}


def _tools() -> list[dict]:
    path = Path(__file__).with_name("test_api_tools.py")
    spec = importlib.util.spec_from_file_location("api_tools_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TOOLS


def _grammars(compiler) -> dict:
    specs = {name: GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True) for name, _, schema in CASES}
    specs["event"] = GrammarSpec(GrammarKind.JSON_SCHEMA, EVENT, strict=True)
    specs["parallel_tool_calls"] = tool_call_spec(parse_tools(_tools(), "required", True))
    return {name: compiler.compile_blocking(spec) for name, spec in specs.items()}


def _hostile_run(grammar, budget: int, seed: int) -> tuple[list[int], bool]:
    """Sample `budget` tokens from the mask alone; (tokens, complete at the end)."""
    rng = random.Random(seed)
    matcher = grammar.new_matcher()
    matcher.set_token_budget(budget)
    stops = set(grammar.stop_token_ids)
    row = torch.zeros((1, grammar.closing_tokens.num_words), dtype=torch.int32)
    tokens: list[int] = []
    for _ in range(budget):
        matcher.fill_bitmask(row, 0)
        allowed = np.flatnonzero(np.unpackbits(row[0].numpy().view(np.uint8), bitorder="little"))
        draw = rng.random()
        if draw < 0.4:
            token_id = int(rng.choice(allowed[:300]))  # low ids: bytes, punctuation, short pieces
        elif draw < 0.8:
            token_id = int(rng.choice(allowed))
        else:
            token_id = int(allowed[-1] if rng.random() < 0.5 else allowed[0])
        if token_id in stops:
            break
        assert matcher.accept_token(token_id)
        tokens.append(token_id)
    return tokens, matcher.is_completed()


def test_every_budget_from_the_shortest_up_ends_complete_whatever_is_sampled(compiler, tokenizer):
    failures = []
    for name, grammar in _grammars(compiler).items():
        shortest = len(plan_completion(grammar.new_matcher()._inner, grammar.closing_tokens, limit=400))
        for budget in sorted({shortest, shortest + 1, shortest + 3, 2 * shortest + 5}):
            for seed in range(3):
                tokens, complete = _hostile_run(grammar, max(budget, 1), seed)
                if not complete:
                    failures.append(f"{name} budget {budget} seed {seed}: {tokenizer.decode(tokens)[-90:]!r}")
    assert not failures, failures


def test_the_plan_is_spelled_the_way_the_tokenizer_spells_it(compiler, tokenizer):
    """Token by token the plan writes `""` then `,`; the tokenizer has `"",`: the shortest close is the latter."""
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, EVENT, strict=True))
    plan = plan_completion(grammar.new_matcher()._inner, grammar.closing_tokens, limit=100)
    text = tokenizer.decode(plan)
    assert json.loads(text)["priority"] is None
    assert len(plan) == len(tokenizer.encode(text, add_special_tokens=False))
    # From inside a half-written character (a sampled byte token), the rest is spelled anew too.
    matcher, ok = feed(grammar, tokenizer, '{"name": "caf')
    assert ok
    half = grammar.closing_tokens.token_bytes.index(b"\xc3")  # the first byte of "é"
    assert matcher._inner.accept_token(half)
    plan = plan_completion(matcher._inner, grammar.closing_tokens, limit=100)
    assert plan is not None and len(plan) <= 22  # token by token it takes 25


@pytest.mark.parametrize("budget", [8, 12])
def test_a_short_regex_with_room_is_left_to_the_model(compiler, budget):
    """Closing early costs the model its own answer: a 4-token regex with twice its length left is not closed."""
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.REGEX, "1[0-9]{3}", param="response_format"))
    matcher = grammar.new_matcher()
    matcher.set_token_budget(budget)
    assert not matcher.closed_by_budget()
