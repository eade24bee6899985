"""What planning the close costs the engine: bounded per output token however long the close is.

Planning walks the matcher token by token (a mask fill and an accept per planned
token), so a grammar whose shortest close is long (two thousand digits, an array
with a large `minItems`) once cost a full walk at every output token near the
end of the budget: quadratic in the output, 40 ms per token per choice on the
engine thread for 2,000 digits. The work is counted here as the backend mask
fills, the unit the planner pays in.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from loraplex.grammar.runtime.closing import plan_completion
from loraplex.grammar.runtime.matcher import StructuredMatcher
from loraplex.grammar.spec import GrammarKind, GrammarSpec

# Each output token may pay for 64 planned tokens at the most, plus its own fill.
MOST_FILLS_PER_TOKEN = 65

MANY_ITEMS = {
    "type": "array", "minItems": 60,
    "items": {"type": "object", "additionalProperties": False, "required": ["id", "name"],
              "properties": {"id": {"type": "integer"}, "name": {"type": "string"}}},
}


class CountingMatcher:
    """A backend matcher that counts its mask fills (one per planned token, one per sampled token)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.fills = 0

    def fill_bitmask(self, bitmask, row):
        self.fills += 1
        return self.inner.fill_bitmask(bitmask, row)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _counted(grammar, walks=None) -> tuple[StructuredMatcher, CountingMatcher]:
    counter = CountingMatcher(grammar.inner.new_matcher())
    shared = () if walks is None else (walks,)
    return StructuredMatcher(counter, grammar.closing_tokens, grammar.stop_token_ids, *shared), counter


def _sample(matcher, grammar, rng, row) -> int | None:
    """One token the mask allows, as a hostile sampler picks it; None for a stop token."""
    matcher.fill_bitmask(row, 0)
    allowed = np.flatnonzero(np.unpackbits(row[0].numpy().view(np.uint8), bitorder="little"))
    token_id = int(rng.choice(allowed[:300]) if rng.random() < 0.5 else rng.choice(allowed))
    if token_id in grammar.stop_token_ids:
        return None
    assert matcher.accept_token(token_id)
    return token_id


def _run(grammar, budget: int, seed: int) -> tuple[list[int], bool, int]:
    """(tokens, complete at the end, mask fills per output token)."""
    matcher, counter = _counted(grammar)
    matcher.set_token_budget(budget)
    rng = random.Random(seed)
    row = torch.zeros((1, grammar.closing_tokens.num_words), dtype=torch.int32)
    tokens: list[int] = []
    while len(tokens) < budget and (token_id := _sample(matcher, grammar, rng, row)) is not None:
        tokens.append(token_id)
    return tokens, matcher.is_completed(), counter.fills / max(len(tokens), 1)


def _shortest(grammar) -> int:
    return len(plan_completion(grammar.inner.new_matcher(), grammar.closing_tokens, limit=4000))


@pytest.mark.parametrize("slack", [0, 1, 3, 40, 400])
def test_a_long_regex_closes_in_bounded_work_and_leaves_the_digits_to_the_model(compiler, tokenizer, slack):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.REGEX, "[0-9]{600}", param="response_format"))
    tokens, complete, fills_per_token = _run(grammar, 600 + slack, seed=slack)
    text = tokenizer.decode(tokens)
    assert complete and len(text) == 600 and text.isdigit()
    assert fills_per_token <= MOST_FILLS_PER_TOKEN, fills_per_token
    if slack >= 40:  # room to spare: the model writes the digits, the planner's "1" only at the very end
        assert sum(digit != "1" for digit in text[:500]) > 300, text


def test_an_array_with_many_required_items_closes_in_bounded_work_whatever_is_sampled(compiler, tokenizer):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, MANY_ITEMS, strict=True))
    shortest = _shortest(grammar)
    assert shortest > 300  # long enough that planning it at every token would show
    failures = []
    for budget in (shortest, shortest + 1, shortest + 5, shortest + 60, 2 * shortest):
        for seed in range(2):
            tokens, complete, fills_per_token = _run(grammar, budget, seed)
            if not complete or fills_per_token > MOST_FILLS_PER_TOKEN:
                failures.append(f"budget {budget} seed {seed}: complete {complete}, {fills_per_token:.0f} fills "
                                f"per token, ends {tokenizer.decode(tokens)[-60:]!r}")
    assert not failures, failures


def test_the_choices_of_a_request_plan_the_first_close_once_and_their_long_walks_in_different_steps(compiler):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.REGEX, "[0-9]{600}", param="response_format"))
    walks: dict = {}
    choices = [_counted(grammar, walks) for _ in range(4)]
    for index, (matcher, _) in enumerate(choices):
        matcher.set_token_budget(700, phase=index)
    assert sum(counter.fills for _, counter in choices) < 1.5 * 600  # one first walk, shared
    rng = random.Random(0)
    row = torch.zeros((1, grammar.closing_tokens.num_words), dtype=torch.int32)
    busiest = 0
    for _ in range(300):
        before = [counter.fills for _, counter in choices]
        for matcher, _ in choices:
            assert _sample(matcher, grammar, rng, row) is not None
        step = sum(counter.fills - was for (_, counter), was in zip(choices, before, strict=True))
        busiest = max(busiest, step)
    # Each step fills one mask per choice; a long walk (about 600 fills, fewer as the digits go) is one choice's.
    assert 500 < busiest < 1.5 * 600, busiest


@pytest.mark.parametrize("backend_kind", ["regex", "json_schema"])
def test_a_long_forced_text_is_forced_in_parts_and_walked_once_for_all_choices(compiler, tokenizer, backend_kind):
    """A 16,000-character constant: each refresh tokenizes and walks only a part of it, the choices of a request
    share the first part, and fed part by part the whole constant comes out."""
    constant = "lorem ipsum dolor sit amet " * 600
    spec = (GrammarSpec(GrammarKind.REGEX, constant, param="response_format") if backend_kind == "regex" else
            GrammarSpec(GrammarKind.JSON_SCHEMA, {"const": constant}, strict=True))
    grammar = compiler.compile_blocking(spec)
    walks: dict = {}
    choices = [_counted(grammar, walks) for _ in range(16)]
    for index, (matcher, _) in enumerate(choices):
        matcher.set_token_budget(40_000, phase=index)
    first = choices[0][0].forced_token_ids()
    assert 0 < len(tokenizer.decode(first)) <= 4096
    assert all(matcher.forced_token_ids() == first for matcher, _ in choices)
    matcher = choices[0][0]
    written = []
    while not matcher.is_completed():
        forced = matcher.forced_token_ids()
        assert 0 < len(forced) <= 2048, len(forced)
        for token_id in forced:
            assert matcher.accept_token(token_id)
        written += forced
    expected = constant if backend_kind == "regex" else json.dumps(constant)
    assert tokenizer.decode(written) == expected


def test_the_walks_a_grammar_remembers_stay_few_and_packed(compiler):
    """Cached grammars are many: each keeps a few first walks, packed, however many budgets its requests ask."""
    from array import array

    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.REGEX, "[0-9]{600}", param="response_format"))
    for budget in range(640, 700):
        grammar.new_matcher().set_token_budget(budget)
        walks = grammar.first_walks
        assert len(walks) <= 16
        assert sum(len(v) for v in walks.values() if isinstance(v, array)) <= 16_384
        assert all(not isinstance(v, list) for v in walks.values())
