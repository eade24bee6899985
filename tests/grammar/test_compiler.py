from __future__ import annotations

import asyncio
import threading

import pytest
from grammar_helpers import SMOLLM2_VOCAB
from loraplex.engine.errors import InvalidRequestError
from loraplex.grammar.compiler import GrammarCompilerService, GrammarLimits
from loraplex.grammar.spec import GrammarKind, GrammarSpec


def test_cache_is_keyed_by_content_not_key_order(compiler):
    a = GrammarSpec(GrammarKind.JSON_SCHEMA, {"type": "object", "properties": {"x": {"type": "integer"}}})
    b = GrammarSpec(GrammarKind.JSON_SCHEMA, {"properties": {"x": {"type": "integer"}}, "type": "object"})
    assert compiler.compile_blocking(a) is compiler.compile_blocking(b)


async def test_concurrent_identical_requests_compile_once(compiler):
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string", "format": "email"} for i in range(5)}}
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, schema)
    before = compiler.num_compiled
    grammars = await asyncio.gather(*(compiler.compile(spec) for _ in range(12)))
    assert len({id(g) for g in grammars}) == 1
    assert compiler.num_compiled - before == 1


@pytest.mark.parametrize(
    ("spec", "param", "needle"),
    [
        (GrammarSpec(GrammarKind.REGEX, "[a-", param="response_format.regex"), "response_format.regex", "Unclosed"),
        (GrammarSpec(GrammarKind.REGEX, "(?<=a)b", param="response_format.regex"), "response_format.regex", "Lookbehind"),
        (GrammarSpec(GrammarKind.EBNF, 'root ::= foo', param="response_format.grammar"), "response_format.grammar", "foo"),
        (GrammarSpec(GrammarKind.EBNF, 'start ::= "a"', param="response_format.grammar"), "response_format.grammar", "root"),
        (GrammarSpec(GrammarKind.JSON_SCHEMA, {"$ref": "#/$defs/missing"}, param="s"), "s", "$defs"),
    ],
)
async def test_bad_grammar_is_a_400_naming_the_field(compiler, spec, param, needle):
    with pytest.raises(InvalidRequestError) as info:
        await compiler.compile(spec)
    assert type(info.value) is InvalidRequestError  # the platform maps it to 400
    assert info.value.param == param
    assert needle in info.value.message
    assert "/project/cpp" not in info.value.message  # xgrammar's source paths are not the user's business


SELF_REQUIRING = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}


@pytest.mark.parametrize("spec", [
    GrammarSpec(GrammarKind.JSON_SCHEMA, {"$ref": "#"}),
    GrammarSpec(GrammarKind.JSON_SCHEMA, {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                          "$ref": "#/$defs/a"}),
    GrammarSpec(GrammarKind.JSON_SCHEMA, SELF_REQUIRING),
    GrammarSpec(GrammarKind.JSON_SCHEMA, {"type": "array", "minItems": 1, "items": SELF_REQUIRING}),
    GrammarSpec(GrammarKind.JSON_SCHEMA, {"anyOf": [SELF_REQUIRING, {"type": "array", "minItems": 1,
                                                                    "items": SELF_REQUIRING}]}),
    GrammarSpec(GrammarKind.EBNF, 'root ::= "x" root', param="response_format.grammar"),
    GrammarSpec(GrammarKind.EBNF, 'root ::= "a" | "b" loop\nloop ::= "x" loop', param="response_format.grammar"),
    GrammarSpec(GrammarKind.EBNF, 'root ::= a\na ::= b\nb ::= a', param="response_format.grammar"),
], ids=["ref-to-itself", "refs-to-each-other", "required-self", "array-of-required-self",
        "a-choice-of-endless-values", "ebnf-without-end",
        "ebnf-rule-without-end-behind-a-choice", "ebnf-rules-referring-to-each-other"])
def test_a_grammar_no_output_completes_is_a_400(compiler, spec):
    """Well formed, yet no finite output matches: refused at compile time (a request ran before, and its empty
    `stop` answer was no JSON, or it ran to its token limit)."""
    with pytest.raises(InvalidRequestError, match="cannot be satisfied") as info:
        compiler.compile_blocking(spec)
    assert info.value.param == spec.param


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
     "required": ["v", "kids"]},  # a tree: recursive, but an empty `kids` ends it
    {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["next"]},
    {"type": "array", "minItems": 300, "items": {"type": "integer"}},  # long, but finite
], ids=["tree", "linked-list", "long-array"])
def test_recursive_and_long_but_finishable_schemas_compile(compiler, schema):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema))
    assert grammar.new_matcher() is not None


@pytest.mark.parametrize("ebnf", ['root ::= "x" root | "x"', 'root ::= item+\nitem ::= [a-z] | "(" root ")"',
                                  'root ::= ("a" root)*', 'root ::= [0-9]{3} "-" [0-9]{4}'])
def test_recursive_ebnf_with_a_way_out_compiles_and_its_matcher_starts(compiler, ebnf):
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.EBNF, ebnf, param="response_format.grammar"))
    assert grammar.new_matcher() is not None  # jump-forward computed at the start, and it returned


def test_spec_size_limit(tokenizer):
    service = GrammarCompilerService(tokenizer, SMOLLM2_VOCAB, GrammarLimits(max_spec_bytes=200))
    try:
        big = GrammarSpec(GrammarKind.CHOICE, [f"choice number {i}" for i in range(50)], param="response_format.choices")
        with pytest.raises(InvalidRequestError, match="too large") as info:
            service.compile_blocking(big)
        assert info.value.param == "response_format.choices"
    finally:
        service.close()


def test_compiled_size_limit(tokenizer):
    service = GrammarCompilerService(tokenizer, SMOLLM2_VOCAB, GrammarLimits(max_compiled_bytes=100))
    try:
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, {"type": "object", "properties": {"e": {"type": "string", "format": "email"}}})
        with pytest.raises(InvalidRequestError, match="over the limit"):
            service.compile_blocking(spec)
    finally:
        service.close()


async def test_compile_time_limit_is_a_400_the_work_is_stopped_and_the_loop_keeps_running(tokenizer):
    service = GrammarCompilerService(tokenizer, SMOLLM2_VOCAB, GrammarLimits(compile_timeout_s=0.5))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    try:
        await service.compile(GrammarSpec(GrammarKind.REGEX, "[a-z]"))  # the worker is up
        pool = service.backends["xgrammar"]._pool
        slow = GrammarSpec(GrammarKind.REGEX, "([a-z0-9]{1,300}){1,300}", param="response_format.regex")  # a minute and more
        with pytest.raises(InvalidRequestError, match="longer than") as info:
            print("compiled", (await service.compile(slow)).compile_ms)
        assert info.value.param == "response_format.regex"
        assert pool.num_killed == 1  # the compilation was stopped, not left running
        assert ticks > 0  # the event loop was never blocked by the compilation
        grammar = await service.compile(GrammarSpec(GrammarKind.REGEX, "[0-9]+"))  # a fresh worker serves on
        assert grammar.new_matcher().accept_token(tokenizer.encode("42", add_special_tokens=False)[0])
    finally:
        task.cancel()
        service.close()


async def test_time_in_the_queue_does_not_count_against_the_limit(tokenizer):
    service = GrammarCompilerService(
        tokenizer, SMOLLM2_VOCAB, GrammarLimits(compile_timeout_s=0.5, num_compile_threads=1)
    )
    try:
        gate = threading.Event()
        service._pool.submit(gate.wait, 10)  # the only compile thread is busy for a while
        waiting = asyncio.create_task(service.compile(GrammarSpec(GrammarKind.REGEX, "[0-9]+")))
        await asyncio.sleep(1.0)  # twice the limit, all of it queued
        assert not waiting.done()
        gate.set()
        grammar = await waiting
        assert grammar.new_matcher().accept_token(tokenizer.encode("42", add_special_tokens=False)[0])
    finally:
        service.close()


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ({"type": "object", "properties": {"n": {"not": {"multipleOf": 3}}}}, "keyword 'not' at #/properties/n"),
        ({"type": "array", "items": {"type": "integer", "maximum": 9}, "uniqueItems": True}, "keyword 'uniqueItems' at #"),
        ({"type": "string", "format": "idn-email"}, "'format: idn-email' at #"),
    ],
)
def test_strict_schema_no_backend_enforces_is_a_400_naming_keyword_and_path(compiler, schema, needle):
    param = "response_format.json_schema.schema"
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, param=param, strict=True))
    assert info.value.param == param
    assert needle in info.value.message and "strict" in info.value.message


def test_non_strict_schema_is_relaxed_and_says_what_it_lost(compiler):
    schema = {"type": "array", "items": {"type": "integer", "maximum": 9}, "uniqueItems": True}  # could run out
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=False))
    assert grammar.backend == "xgrammar"
    assert "uniqueItems" in grammar.relaxed


def test_auto_picks_an_exact_backend(compiler):
    exact = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}, "required": ["n"]}
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, exact, strict=True))
    assert grammar.backend == "llguidance" and grammar.relaxed is None
    regex = compiler.compile_blocking(GrammarSpec(GrammarKind.REGEX, "[a-z]+"))
    assert regex.backend == "xgrammar"


def test_disjoint_one_of_is_enforced_exactly_and_overlapping_one_of_is_refused(compiler, tokenizer):
    disjoint = {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "card"}, "last4": {"type": "string"}},
         "required": ["kind", "last4"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "cash"}}, "required": ["kind"], "additionalProperties": False},
        {"type": "integer"},
    ]}
    grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, disjoint, strict=True))
    for text, ok in (('{"kind": "cash"}', True), ('{"kind": "card", "last4": "1234"}', True), ("12", True),
                     ('{"kind": "cash", "last4": "1"}', False), ('"cash"', False)):
        matcher = grammar.new_matcher()
        accepted = all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
        assert (accepted and matcher.is_completed()) == ok, text
    overlapping = {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}  # 5 matches both: invalid
    with pytest.raises(InvalidRequestError, match="keyword 'oneOf' at #"):
        compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, overlapping, strict=True))


async def test_a_value_nested_too_deep_for_the_passes_is_a_400_not_a_500(compiler):
    # the edge refuses it first (grammar/schema/walk.value_nesting_limit); the compiler must not answer 500 either
    deep: object = 1
    for _ in range(600):
        deep = [deep]
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"}, "c": {"const": deep}}}
    with pytest.raises(InvalidRequestError, match="nests too deep to compile") as info:
        await compiler.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, param="response_format.json_schema.schema"))
    assert info.value.param == "response_format.json_schema.schema"
