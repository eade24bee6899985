from __future__ import annotations

import json

import pytest
import torch
from grammar_helpers import SMOLLM2_VOCAB, feed
from loraplex.grammar.spec import GrammarKind, GrammarSpec
from token_bitmask import allowed_token_ids

WORDS = (SMOLLM2_VOCAB + 31) // 32


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    return set(allowed_token_ids(bitmask[row], SMOLLM2_VOCAB))


def test_json_ends_at_the_closing_brace_without_a_stop_token(compiler, tokenizer):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
    }))
    matcher, ok = feed(grammar, tokenizer, '{"a": 12')
    assert ok and not matcher.is_terminated() and not matcher.is_completed()
    assert matcher.accept_token(tokenizer.encode("}", add_special_tokens=False)[0])
    assert matcher.is_terminated()
    assert not matcher.accept_token(tokenizer.encode(" ", add_special_tokens=False)[0])  # no trailing junk


def test_grammar_that_may_go_on_waits_for_the_stop_token(compiler, tokenizer):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.REGEX, "[a-z]+"))
    matcher, ok = feed(grammar, tokenizer, "hello")
    assert ok and matcher.is_completed() and not matcher.is_terminated()
    bitmask = torch.zeros((2, WORDS), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 1)
    row = allowed(bitmask, 1)
    assert tokenizer.eos_token_id in row and tokenizer.encode("world", add_special_tokens=False)[0] in row
    assert not bitmask[0].any()  # other rows untouched
    assert matcher.accept_token(tokenizer.eos_token_id)
    assert matcher.is_terminated()


def test_choice_prefix_of_another_choice(compiler, tokenizer):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.CHOICE, ["yes", "yes please", "no"]))
    matcher, ok = feed(grammar, tokenizer, "no")
    assert ok and matcher.is_terminated()
    matcher, ok = feed(grammar, tokenizer, "yes")
    assert ok and matcher.is_completed() and not matcher.is_terminated()
    _, ok = feed(grammar, tokenizer, "maybe")
    assert not ok


@pytest.mark.parametrize("strict", [True, False])
def test_fill_bitmask_is_the_backend_row_or_the_one_forced_token(compiler, tokenizer, strict):
    """Free positions get the backend's own mask; forced text (keys, enum rest) exactly one token."""
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, {"type": "object", "properties": {"tag": {"enum": ["red", "green"]}}},
                       strict=strict)
    grammar = compiler.compile_blocking(spec)
    ours = grammar.new_matcher()
    reference = grammar.inner.new_matcher()
    bitmask = torch.zeros((3, WORDS), dtype=torch.int32)
    expected = torch.zeros((1, WORDS), dtype=torch.int32)
    num_forced = 0
    for token in tokenizer.encode('{"tag": "green"}', add_special_tokens=False):
        ours.fill_bitmask(bitmask, 2)
        forced = ours.forced_token_ids()
        if forced:
            num_forced += 1
            assert allowed(bitmask, 2) == {forced[0]}
            token = forced[0]  # the text is forced; follow the grammar's own spelling of it
        else:
            reference.fill_bitmask(expected, 0)
            assert torch.equal(bitmask[2], expected[0])
        assert ours.accept_token(token) and reference.accept_token(token)
        if ours.is_terminated():
            break
    assert num_forced > 0
    assert ours.is_terminated()


def test_unfinished_json_is_not_complete(compiler, tokenizer):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_OBJECT))
    matcher, ok = feed(grammar, tokenizer, '{"name": "Ada", "langs": ["en"')
    assert ok and not matcher.is_completed() and not matcher.is_terminated()
    bitmask = torch.zeros((1, WORDS), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    assert tokenizer.eos_token_id not in allowed(bitmask, 0)  # the model cannot stop inside the JSON


def test_json_object_accepts_any_object(compiler, tokenizer):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_OBJECT))
    value = {"a": [1, 2.5, None, True], "b": {"c": "d"}}
    matcher, ok = feed(grammar, tokenizer, json.dumps(value))
    assert ok and matcher.is_terminated()
    _, ok = feed(grammar, tokenizer, "[1, 2]")
    assert not ok


def test_the_closing_plan_ends_a_date_time_inside_its_fraction_of_a_second(compiler, tokenizer):
    """The fraction of a second admits digits forever: the plan must still reach the time zone and close."""
    from loraplex.grammar.runtime.closing import plan_completion

    schema = {"type": "object", "properties": {"timestamp": {"type": "string", "format": "date-time"}},
              "required": ["timestamp"], "additionalProperties": False}
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True))
    for prefix in ('{"timestamp": "2023-08-11T15:50:17', '{"timestamp": "2023-08-11T15:50:17.25878187'):
        matcher, ok = feed(grammar, tokenizer, prefix)
        assert ok
        plan = plan_completion(matcher._inner, matcher._tokens, limit=32)
        assert plan is not None, prefix
        text = prefix + tokenizer.decode(plan)
        assert json.loads(text)["timestamp"].startswith("2023-08-11T15:50:17"), text


def test_the_closing_plan_ends_an_email_cut_before_its_at_sign(compiler, tokenizer):
    """An email's local part admits letters, digits and brackets forever: the plan must reach `@` and close."""
    import jsonschema
    from loraplex.grammar.runtime.closing import plan_completion

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string", "format": "email"}},
              "required": ["name", "email"], "additionalProperties": False}
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True))
    for prefix in ('{"name": "Al", "email": "', '{"name": "Al", "email": "alice.smith', '{"name": "Al", "email": "a@b.'):
        matcher, ok = feed(grammar, tokenizer, prefix)
        assert ok
        plan = plan_completion(matcher._inner, matcher._tokens, limit=16)
        assert plan is not None, prefix
        text = prefix + tokenizer.decode(plan)
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
