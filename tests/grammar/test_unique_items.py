"""uniqueItems over string arrays, checked by the matcher: the same language as the schema, masks that never
offer a duplicate, and no dead end; anything the check cannot make exact is still refused in strict mode."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
from grammar_helpers import SMOLLM2_VOCAB
from loraplex.engine.errors import InvalidRequestError
from loraplex.grammar.schema.unique_items import without_checked_unique_items
from loraplex.grammar.spec import GrammarKind, GrammarSpec
from token_bitmask import allowed_token_ids

TAGS = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
SCHEMAS = [
    TAGS,
    {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$"}, "uniqueItems": True},
        "other": {"type": "array", "items": {"type": "string"}}}},
    {"type": "object", "properties": {"r": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/set"}]}},
     "$defs": {"set": {"type": "array", "items": {"type": "string", "minLength": 1}, "uniqueItems": True}}},
    {"type": "array", "items": {"type": "object", "patternProperties": {"^s": {"$ref": "#/$defs/set"}},
                                "additionalProperties": {"type": "array", "items": {"type": "string"}}},
     "$defs": {"set": TAGS}},
]
TEXTS = [
    '["a", "b"]', '["a", "a"]', '["a", "b", "a"]', '[]', '["ab", "a"]', '["a", "ab"]', '["\\u0061", "a"]',
    '["a\\"", "a"]', '["a\\"", "a\\""]', '["é", "é"]', '["é", "e"]',
    '{"tags": ["x", "y"], "other": ["y", "y"]}', '{"tags": ["x", "x"], "other": ["y"]}', '{"tags": ["Q"]}',
    '{"r": "a"}', '{"r": ["a", "b"]}', '{"r": ["a", "a"]}', '{"r": [""]}',
    '[{"s1": ["a", "a"]}]', '[{"t": ["a", "a"]}]', '[{"t": ["a"], "s": ["b", "c", "b"]}]', '[{"s": ["a"]}, {"s": ["a"]}]',
]


def accepted(grammar, tokenizer, text: str) -> bool:
    matcher = grammar.new_matcher()
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and \
        matcher.is_completed()


def allowed_ids_after(grammar, tokenizer, text: str) -> set[int]:
    """The token ids the grammar's mask allows once `text` is written."""
    matcher = grammar.new_matcher()
    assert all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)), text
    mask = torch.zeros((1, (SMOLLM2_VOCAB + 31) // 32), dtype=torch.int32)
    matcher.fill_bitmask(mask, 0)
    bits = (mask[0].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
    return set(bits.flatten().nonzero().flatten().tolist())


def allowed_bytes_after(grammar, tokenizer, text: str) -> set[bytes]:
    """The bytes of the tokens the grammar's mask allows once `text` is written."""
    token_bytes = grammar.closing_tokens.token_bytes
    return {token_bytes[i] for i in allowed_ids_after(grammar, tokenizer, text) if i < len(token_bytes)}


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_the_grammar_accepts_exactly_the_schemas_language(compiler, tokenizer, schema):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True))
    assert grammar.relaxed is None
    checked = 0
    for text in TEXTS:
        value = json.loads(text)
        expected = jsonschema.Draft202012Validator(schema).is_valid(value)
        assert accepted(grammar, tokenizer, text) == expected, text
        checked += expected
    assert checked >= 3


def test_the_mask_never_offers_the_close_of_a_duplicate(compiler, tokenizer):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, TAGS, strict=True))
    closers = [t for t in ('"', '"]', '",', '",') if len(tokenizer.encode(t, add_special_tokens=False)) == 1]
    assert closers
    ids = [tokenizer.encode(t, add_special_tokens=False)[0] for t in closers]

    def allowed_after(text: str) -> list[bool]:
        allowed = allowed_ids_after(grammar, tokenizer, text)
        return [i in allowed for i in ids]

    assert not any(allowed_after('["ab", "cd", "ab'))
    assert all(allowed_after('["ab", "cd", "ac'))
    assert all(allowed_after('["ab", "cd", "a'))


def test_random_walks_never_dead_end_and_end_valid(compiler, tokenizer):
    schema = {"type": "object", "properties": {"tags": SCHEMAS[1]["properties"]["tags"]}, "required": ["tags"],
              "additionalProperties": False}
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True))
    rng = random.Random(7)
    prefix = tokenizer.encode('{"tags": ["a", "b", "', add_special_tokens=False)
    short = [i for i in range(SMOLLM2_VOCAB) if len(tokenizer.decode([i])) <= 2]
    for _ in range(3):
        matcher = grammar.new_matcher()
        assert all(matcher.accept_token(t) for t in prefix)
        tokens = list(prefix)
        for _ in range(40):
            mask = torch.zeros((1, (SMOLLM2_VOCAB + 31) // 32), dtype=torch.int32)
            matcher.fill_bitmask(mask, 0)
            allowed = set(allowed_token_ids(mask[0], SMOLLM2_VOCAB))
            choices = [i for i in short if i in allowed]
            if matcher.is_completed():
                break
            assert choices, tokenizer.decode(tokens)  # never a dead end
            # lean on the quote tokens, so items close (and duplicates are tried) often
            quoted = [i for i in choices if '"' in tokenizer.decode([i])]
            token = rng.choice(quoted if quoted and rng.random() < 0.5 else choices)
            assert matcher.accept_token(token)
            tokens.append(token)
        text = tokenizer.decode(tokens)
        if matcher.is_completed():
            assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text
        items = re.findall(r'"([a-z]+)"', text.split("[", 1)[1])  # the items closed so far
        assert len(items) == len(set(items)), text


def test_rollback_restores_what_was_seen(compiler, tokenizer):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, TAGS, strict=True))

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    def feeds(matcher, text):
        tokens = encode(text)
        done = all(matcher.accept_token(t) for t in tokens) and matcher.is_completed()
        return done

    matcher = grammar.inner.new_matcher()
    second = encode(', "b"')
    assert all(matcher.accept_token(t) for t in encode('["a"') + second)
    assert not feeds(grammar.inner.new_matcher(), '["a", "b", "b"]')
    matcher.rollback(len(second))  # "b" is forgotten, "a" is not
    assert not feeds(matcher, ', "a"]')
    matcher = grammar.inner.new_matcher()
    assert all(matcher.accept_token(t) for t in encode('["a"') + second)
    matcher.rollback(len(second))
    assert feeds(matcher, ', "c", "b"]')


@pytest.mark.parametrize("schema", [
    {"anyOf": [{"type": "array"}, TAGS]},                                      # a sibling admits duplicates
    {"type": "array", "items": {"type": "string", "maxLength": 1}, "uniqueItems": True},  # could run out
    {"type": "array", "items": {"type": "string", "pattern": "^a$"}, "uniqueItems": True},
    {"type": "array", "items": {"type": "object", "additionalProperties": False}, "uniqueItems": True},
    {"type": "object", "if": {"required": ["a"]}, "then": {"properties": {"b": TAGS}}},
    {"type": "array", "items": {"type": "integer", "maximum": 9}, "uniqueItems": True},   # could run out
    {"type": "array", "items": {"type": "integer", "minimum": -5}, "uniqueItems": True},  # -5 cannot grow
    {"type": "array", "items": {"type": "number", "maximum": 1}, "uniqueItems": True},    # 1 cannot grow
])
def test_what_the_matcher_cannot_check_exactly_stays_refused(compiler, schema):
    assert without_checked_unique_items(schema)[1] is None
    with pytest.raises(InvalidRequestError, match=r"uniqueItems|not supported|cannot be enforced"):
        compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, param="s", strict=True))


FEATURES = ["sign-extension", "simd", "threads", "tail-call", "bulk", "bulk-memory", "s", "mutable-globals"]
ENUM_SET = {"type": "object", "properties": {"f": {"type": "array", "items": {"type": "string", "enum": FEATURES},
                                                   "uniqueItems": True}}, "required": ["f"], "additionalProperties": False}


def test_a_set_of_enum_values_is_checked_exactly(compiler, tokenizer):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, ENUM_SET, strict=True))
    for text in ('{"f": []}', '{"f": ["simd", "s"]}', '{"f": ["simd", "simd"]}', '{"f": ["bulk", "bulk-memory"]}',
                 '{"f": ["bulk-memory", "bulk", "bulk"]}', '{"f": ["x"]}'):
        assert accepted(grammar, tokenizer, text) == jsonschema.Draft202012Validator(ENUM_SET).is_valid(
            json.loads(text)), text


def test_a_set_of_enum_values_never_dead_ends_when_every_value_is_used(compiler, tokenizer):
    """The walk avoids closing the array, so it uses up every value: then only the close is left to it."""
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, ENUM_SET, strict=True))
    rng = random.Random(3)
    token_bytes = grammar.closing_tokens.token_bytes
    for _ in range(3):
        matcher, tokens = grammar.new_matcher(), []
        while not matcher.is_terminated() and len(tokens) < 200:
            mask = torch.zeros((1, (SMOLLM2_VOCAB + 31) // 32), dtype=torch.int32)
            matcher.fill_bitmask(mask, 0)
            choices = [i for i in allowed_token_ids(mask[0], len(token_bytes)) if i not in grammar.stop_token_ids]
            assert choices, tokenizer.decode(tokens)  # never a dead end
            going_on = [i for i in choices if b"]" not in token_bytes[i]]
            token = rng.choice(going_on or choices)
            assert matcher.accept_token(token)
            tokens.append(token)
        assert sorted(json.loads(tokenizer.decode(tokens))["f"]) == sorted(FEATURES)


def test_a_few_enum_values_become_the_enum_of_their_arrays(compiler, tokenizer):
    from loraplex.grammar.schema.passes import prepare_schema

    schema = {"type": "array", "items": {"enum": ["esm", "raw"]}, "uniqueItems": True}
    assert prepare_schema(schema).schema == {"enum": [[], ["esm"], ["raw"], ["esm", "raw"], ["raw", "esm"]]}
    contains = {"type": "array", "items": {"enum": [1, 2, 3]}, "contains": {"const": 2}, "maxItems": 2}
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, contains, strict=True))
    for value in ([2], [1, 2], [1, 3], [], [2, 2], [1, 2, 2], [4, 2]):
        assert accepted(grammar, tokenizer, json.dumps(value)) == jsonschema.Draft202012Validator(
            contains).is_valid(value), value


OBJECTS = {"type": "array", "items": {"type": "object"}, "uniqueItems": True}


@pytest.mark.parametrize(("text", "valid"), [
    ('[{"a": 1}, {"a": 2}]', True), ('[{"a": 1}, {"a": 1}]', False), ('[{"a": 1}, {"a": 1.0}]', False),
    ('[{"a": 1, "b": 2}, {"b": 2, "a": 1}]', False), ('[{}, {}]', False), ('[{"a": true}, {"a": 1}]', True),
    ('[{"a": {"x": [1]}}, {"a": {"x": [1]}}]', False), ('[{"a": {"x": [1]}}, {"a": {"x": [1, 1]}}]', True),
    ('[{"a": "\\u0041"}, {"a": "A"}]', False), ('[{"a": 1}, {"b": 1}, {"a": 1}]', False),
])
def test_open_objects_are_compared_whole(compiler, tokenizer, text, valid):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, OBJECTS, strict=True))
    assert jsonschema.Draft202012Validator(OBJECTS).is_valid(json.loads(text)) == valid
    assert accepted(grammar, tokenizer, text) == valid


def test_a_duplicate_object_cannot_close_but_can_go_on(compiler, tokenizer):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, OBJECTS, strict=True))
    texts = allowed_bytes_after(grammar, tokenizer, '[{"a": 1}, {"a": 1')
    assert not any(t.startswith(b"}") for t in texts)  # the duplicate's close is masked
    assert any(t.startswith(b",") for t in texts)  # another key is not


INTEGERS = {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer", "multipleOf": 3},
                                                     "uniqueItems": True}}}


@pytest.mark.parametrize("text", [
    '{"ids": [3, 6]}', '{"ids": [3, 3]}', '{"ids": [3, 6, 3]}', '{"ids": [0, -0]}', '{"ids": [-3, 3]}',
    '{"ids": [30, 3, 300]}', '{"ids": [33, 3, 33]}', '{"ids": [0, 9, 0]}', '{"ids": [4]}', '{"ids": []}',
])
def test_integers_are_compared_once_closed(compiler, tokenizer, text):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, INTEGERS, strict=True))
    assert accepted(grammar, tokenizer, text) == jsonschema.Draft202012Validator(INTEGERS).is_valid(json.loads(text))


def test_a_duplicate_integer_cannot_close_but_can_grow(compiler, tokenizer):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, INTEGERS, strict=True))

    def allowed_after(text: str) -> set[bytes]:
        return allowed_bytes_after(grammar, tokenizer, text)

    after_duplicate = allowed_after('{"ids": [6, 3, 6')
    assert not any(t[:1] in (b",", b"]") for t in after_duplicate)  # 6 is taken
    assert b"0" in after_duplicate  # 60 is not
    after_new = allowed_after('{"ids": [6, 3')
    assert any(t[:1] == b"," for t in after_new) and any(t[:1] == b"]" for t in after_new)
    after_zero = allowed_after('{"ids": [0, ')
    assert not any(t.startswith((b"0", b"-0")) for t in after_zero)  # 0 is taken, and nothing follows a 0
    assert any(t[:1] == b"3" for t in after_zero)


NUMBERS = {"type": "array", "items": {"type": "number"}, "uniqueItems": True}


@pytest.mark.parametrize("text", [
    "[1, 1.0]", "[1, 1.5]", "[0, -0.0]", "[0.5, 5e-1]", "[1e2, 100]", "[1e2, 10]", "[-1, 1]", "[2.5, 3, 2.5]",
])
def test_numbers_are_compared_as_values(compiler, tokenizer, text):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, NUMBERS, strict=True))
    assert accepted(grammar, tokenizer, text) == jsonschema.Draft202012Validator(NUMBERS).is_valid(json.loads(text))


def test_a_duplicate_zero_number_can_grow_a_fraction(compiler, tokenizer):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, NUMBERS, strict=True))
    allowed = allowed_bytes_after(grammar, tokenizer, "[0, 0")
    assert not any(t[:1] in (b",", b"]") for t in allowed) and b"." in allowed


def _many_words(tokenizer) -> list[str]:
    """A thousand lowercase words that are each one token: at an item's start every one of them is a candidate."""
    words = sorted(t for t in tokenizer.get_vocab() if t.isascii() and t.isalpha() and t.islower() and len(t) >= 5)
    return words[:1000]


def _many_set(words: list[str]) -> dict:
    return {"type": "object", "properties": {"f": {"type": "array", "items": {"type": "string", "enum": words},
                                                   "uniqueItems": True}}, "required": ["f"], "additionalProperties": False}


@pytest.mark.parametrize("written", [1, 2])
def test_a_large_enum_set_is_masked_by_prefix_without_scanning_each_token(compiler, tokenizer, monkeypatch, written):
    """A thousand values: the mask at an item's start is the one scanning every allowed token gives, but plain
    tokens are answered by one bisection each (a scan per token and a pass over every value cost ~100 ms a row a
    step), and a value already written is not offered again."""
    from loraplex.grammar.runtime import unique_items

    words = _many_words(tokenizer)
    assert len(words) == 1000
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, _many_set(words), strict=True))
    text = '{"f": [' + "".join(f'"{word}", ' for word in words[:written]) + '"'
    matcher = grammar.new_matcher()
    assert all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)), text
    checker = matcher._inner  # the uniqueItems wrapper around the backend matcher
    unmasked = torch.zeros((1, (SMOLLM2_VOCAB + 31) // 32), dtype=torch.int32)
    checker._inner.fill_bitmask(unmasked, 0)
    token_bytes = grammar.closing_tokens.token_bytes
    candidates = list(allowed_token_ids(unmasked[0], len(token_bytes)))
    assert len(candidates) > 900
    state = checker._history[-1]
    expected = {i for i in candidates if unique_items.next_state(state, token_bytes[i], checker._plan, checker._text)}
    scans = []
    real_scan = unique_items.scan
    monkeypatch.setattr(unique_items, "scan", lambda *args, **kwargs: scans.append(1) or real_scan(*args, **kwargs))
    mask = torch.zeros_like(unmasked)
    matcher.fill_bitmask(mask, 0)
    assert set(allowed_token_ids(mask[0], len(token_bytes))) == expected
    assert len(scans) < 100 < len(candidates), (len(scans), len(candidates))  # only tokens with a quote are scanned
    for word in words[:written]:
        if not any(other != word and other.startswith(word) for other in words):
            assert tokenizer.convert_tokens_to_ids(word) not in expected, word
