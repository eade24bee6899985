"""response_format through the real server and the real `openai` client, on SmolLM2."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from loraplex.grammar.runtime.closing import plan_completion
from loraplex.grammar.spec import GrammarKind, GrammarSpec
from schema_suite import CASES

MODEL = "SmolLM2-135M-Instruct"
FORMATS = jsonschema.FormatChecker()


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=server.keys["all"], max_retries=0, timeout=1800)


def schema_format(name: str, schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


def ask(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt + " Answer in JSON."}]


def check_json_answer(text: str | None, finish_reason: str, schema: dict) -> bool:
    """True if the answer validates; a `length` finish too, as the budget closes the JSON."""
    assert finish_reason in ("stop", "length")
    jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)
    return True


def test_schema_suite_greedy_and_sampled_all_valid(api_server):
    """Every case of the suite, greedy and sampled, in one concurrent burst: each output validates."""
    assert len(CASES) >= 30

    async def run() -> list:
        client = async_client(api_server)
        calls = []
        for name, prompt, schema in CASES:
            for temperature in (0.0, 0.9):
                calls.append(client.chat.completions.create(
                    model=MODEL, messages=ask(prompt), max_tokens=200, temperature=temperature, seed=7,
                    response_format=schema_format(name, schema),
                ))
        try:
            return await asyncio.gather(*calls)
        finally:
            await client.close()

    answers = asyncio.run(run())
    failures = []
    for (name, _, schema), pair in zip(CASES, zip(answers[::2], answers[1::2], strict=True), strict=True):
        for label, answer in zip(("greedy", "sampled"), pair, strict=True):
            choice = answer.choices[0]
            if not check_json_answer(choice.message.content, choice.finish_reason, schema):
                failures.append(f"{name} ({label}) ran out of tokens: {choice.message.content[:80]!r}")
    assert not failures, failures


def test_a_budget_below_any_valid_answer_ends_with_length(openai_client):
    name, prompt, schema = CASES[7]  # order: its shortest valid answer needs far more than 6 tokens
    answer = openai_client.chat.completions.create(
        model=MODEL, messages=ask(prompt), max_tokens=6, temperature=0, response_format=schema_format(name, schema),
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


BUDGET_CASES = ("person", "order", "nested_company", "recipe", "inventory_defs", "flight")


def test_every_budget_that_allows_a_valid_answer_gets_one(api_server, compiler):
    """Schemas x max_tokens from the shortest valid answer up: every response parses and validates,
    `length` finishes included (the budget closed the JSON)."""
    cases = [case for case in CASES if case[0] in BUDGET_CASES]
    calls = []
    for name, prompt, schema in cases:
        grammar = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=True))
        shortest = len(plan_completion(grammar.new_matcher()._inner, compiler.closing_tokens, limit=400))
        for max_tokens in (shortest, shortest + 3, 2 * shortest, 160):
            calls.append((name, prompt, schema, max_tokens))

    async def run() -> list:
        client = async_client(api_server)
        try:
            return await asyncio.gather(*(
                client.chat.completions.create(
                    model=MODEL, messages=ask(prompt), max_tokens=max_tokens, temperature=1.0, seed=max_tokens,
                    response_format=schema_format(name, schema))
                for name, prompt, schema, max_tokens in calls))
        finally:
            await client.close()

    finishes = []
    for (name, _, schema, max_tokens), answer in zip(calls, asyncio.run(run()), strict=True):
        choice = answer.choices[0]
        assert answer.usage.completion_tokens <= max_tokens
        try:
            check_json_answer(choice.message.content, choice.finish_reason, schema)
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{name} max_tokens={max_tokens} {choice.finish_reason}: {choice.message.content!r}: {exc}")
        finishes.append(choice.finish_reason)
    assert "length" in finishes  # the small budgets were closed by the budget, and still validate


def test_json_object(openai_client):
    answer = openai_client.chat.completions.create(
        model=MODEL, messages=ask("Describe a cat with a name and an age."), max_tokens=120, temperature=0,
        response_format={"type": "json_object"},
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


def test_non_strict_schema_is_enforced_too(openai_client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}
    answer = openai_client.chat.completions.create(
        model=MODEL, messages=ask("Which city is the capital of Italy?"), max_tokens=40, temperature=0,
        response_format=schema_format("city", schema, strict=False),
    )
    assert check_json_answer(answer.choices[0].message.content, answer.choices[0].finish_reason, schema)


def test_relaxed_schema_says_what_was_relaxed_and_a_strict_one_says_nothing(openai_client):
    relaxed = {"type": "array", "items": {"type": "integer", "maximum": 9}, "uniqueItems": True, "maxItems": 3}
    raw = openai_client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ask("Three small numbers."), max_tokens=24, temperature=0,
        response_format=schema_format("numbers", relaxed, strict=False),
    )
    assert "uniqueItems" in raw.headers["x-loraplex-grammar-relaxed"]
    answer = raw.parse()
    assert isinstance(json.loads(answer.choices[0].message.content), list)  # the rest is enforced
    exact = {"type": "object", "properties": {"n": {"not": {"type": "string"}}}, "required": ["n"]}
    raw = openai_client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ask("A number n."), max_tokens=24, temperature=0,
        response_format=schema_format("n", exact, strict=True),  # `not` rewritten exactly: nothing relaxed
    )
    assert "x-loraplex-grammar-relaxed" not in raw.headers
    choice = raw.parse().choices[0]
    assert check_json_answer(choice.message.content, choice.finish_reason, exact)


@pytest.mark.parametrize(
    ("response_format", "prompt", "check"),
    [
        ({"type": "regex", "regex": r"[0-9]{3}-[0-9]{4}"}, "Give me a phone number.",
         lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)),
        ({"type": "choice", "choices": ["positive", "negative", "neutral"]}, "Sentiment of 'I love it'?",
         lambda text: text in ("positive", "negative", "neutral")),
        ({"type": "grammar", "grammar": 'root ::= "The answer is " [0-9]+ "."'}, "What is 6 times 7?",
         lambda text: re.fullmatch(r"The answer is [0-9]+\.", text)),
    ],
    ids=["regex", "choice", "ebnf"],
)
def test_regex_choice_and_ebnf_on_chat(openai_client, response_format, prompt, check):
    answer = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=30, temperature=0,
        extra_body={"response_format": response_format},
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice
    assert check(choice.message.content), choice.message.content


def test_response_format_on_completions(openai_client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 100}},
              "required": ["answer"], "additionalProperties": False}
    answer = openai_client.completions.create(
        model=MODEL, prompt="Question: what is 2 + 3? Reply as JSON.\nAnswer: ", max_tokens=20, temperature=0,
        extra_body={"response_format": schema_format("sum", schema)},
    )
    assert check_json_answer(answer.choices[0].text, answer.choices[0].finish_reason, schema)
    regex = openai_client.completions.create(
        model=MODEL, prompt="The year the Berlin wall fell:", max_tokens=8, temperature=0,
        extra_body={"response_format": {"type": "regex", "regex": "1[0-9]{3}"}},
    )
    assert re.fullmatch("1[0-9]{3}", regex.choices[0].text) and regex.choices[0].finish_reason == "stop"


def test_streamed_json_matches_the_whole_answer(openai_client):
    name, prompt, schema = CASES[0]
    kwargs = {"model": MODEL, "messages": ask(prompt), "max_tokens": 60, "temperature": 0,
              "response_format": schema_format(name, schema)}
    whole = openai_client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(openai_client.chat.completions.create(stream=True, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    jsonschema.validate(json.loads(streamed), schema)


def test_mixed_batch_rows_match_their_solo_runs(api_server, openai_client):
    """Grammar and plain requests in one batch: each row gets exactly what it gets alone (greedy)."""
    requests = [
        {"messages": ask(CASES[i][1]), "response_format": schema_format(CASES[i][0], CASES[i][2])} for i in (0, 3, 9)
    ] + [
        {"messages": [{"role": "user", "content": "Name three colours."}]},
        {"messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
        {"messages": [{"role": "user", "content": "Pick one."}],
         "response_format": {"type": "choice", "choices": ["red", "green", "blue"]}},
    ]
    solo = [
        openai_client.chat.completions.create(model=MODEL, max_tokens=40, temperature=0, **r).choices[0].message.content
        for r in requests
    ]

    async def together() -> list[str]:
        client = async_client(api_server)
        try:
            answers = await asyncio.gather(*(
                client.chat.completions.create(model=MODEL, max_tokens=40, temperature=0, **r) for r in requests
            ))
        finally:
            await client.close()
        return [a.choices[0].message.content for a in answers]

    assert asyncio.run(together()) == solo
    assert solo[5] in ("red", "green", "blue")
    assert solo[3] and not solo[3].startswith("{")  # the plain rows were not constrained


BAD_FORMATS = [
    ({"type": "yaml"}, "response_format.type"),
    (schema_format("bad", {"type": "strnig"}), "response_format.json_schema.schema"),
    (schema_format("bad", {"type": "array", "uniqueItems": True}, strict=True), "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "no spaces allowed", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "regex", "regex": "[a-"}, "response_format.regex"),
    ({"type": "regex", "regex": "(?<=a)b"}, "response_format.regex"),
    ({"type": "grammar", "grammar": "root ::= undefined_rule"}, "response_format.grammar"),
    ({"type": "choice", "choices": []}, "response_format.choices"),
    (schema_format("bad", {"$ref": "#/$defs/missing"}), "response_format.json_schema.schema"),
    # well formed, but no finite JSON value: these used to answer an empty "stop" that is no JSON
    (schema_format("endless", {"$ref": "#"}), "response_format.json_schema.schema"),
    (schema_format("endless", {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}),
     "response_format.json_schema.schema"),
]


@pytest.mark.parametrize(("response_format", "param"), BAD_FORMATS)
def test_bad_response_format_is_an_openai_400(openai_client, response_format, param):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_body={"response_format": response_format},
        )
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
    assert info.value.body["message"]


def test_bad_response_format_on_completions_is_a_400(openai_client):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                          extra_body={"response_format": {"type": "regex", "regex": "("}})
    assert info.value.body["param"] == "response_format.regex"


def test_pydantic_model_through_the_sdks_parse_helper(openai_client):
    """The way most users ask: `chat.completions.parse(response_format=Model)`. The SDK sends a strict schema with
    every property required; a budget that runs out still leaves JSON the model validates (the SDK raises on a
    `length` finish, with the completion attached)."""
    from typing import Literal

    from pydantic import BaseModel

    class Event(BaseModel):
        name: str
        date: str
        participants: list[str]
        kind: Literal["meeting", "party", "other"]
        priority: int | None = None

    messages = ask("Alice and Bob are going to a science fair on Friday.")
    full = openai_client.chat.completions.parse(model=MODEL, messages=messages, response_format=Event,
                                                max_tokens=200, temperature=0)
    assert isinstance(full.choices[0].message.parsed, Event)
    cut_short = []
    for max_tokens in (24, 27, 40):  # 24: the shortest such event the tokenizer can spell
        try:
            completion = openai_client.chat.completions.parse(
                model=MODEL, messages=messages, response_format=Event, max_tokens=max_tokens, temperature=1.0,
                seed=max_tokens)
        except openai.LengthFinishReasonError as cut:  # the budget closed it: still valid
            completion = cut.completion
            cut_short.append(max_tokens)
        assert completion.usage.completion_tokens <= max_tokens
        Event.model_validate_json(completion.choices[0].message.content)
    assert 24 in cut_short  # nothing shorter exists: the budget had to close it
