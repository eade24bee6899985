"""Tool calls through the real server and the real `openai` client, on SmolLM2."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CONVERT = {
    "type": "function",
    "function": {
        "name": "convert_currency",
        "description": "Convert an amount of money from one currency to another",
        "parameters": {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "minimum": 0, "maximum": 1000000},
                "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
            },
            "required": ["amount", "from", "to"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CONVERT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WEATHER_PROMPT = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


def check_calls(message, *, allowed: set[str]) -> list[tuple[str, dict]]:
    calls = []
    for call in message.tool_calls or []:
        assert call.type == "function"
        assert call.id.startswith("call_") and len(call.id) > 10
        assert call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    assert len({c.id for c in message.tool_calls or []}) == len(calls)
    return calls


def create(client, **kwargs):
    kwargs = {"model": MODEL, "temperature": 0, "max_tokens": 80, "tools": TOOLS, **kwargs}
    return client.chat.completions.create(**kwargs)


def test_required_single_call(openai_client):
    answer = create(openai_client, messages=WEATHER_PROMPT, tool_choice="required", parallel_tool_calls=False)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = check_calls(choice.message, allowed=set(SCHEMAS))
    assert len(calls) == 1


def test_named_function_only_that_tool(openai_client):
    answer = create(openai_client, messages=WEATHER_PROMPT,
                    tool_choice={"type": "function", "function": {"name": "convert_currency"}})
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [name for name, _ in check_calls(choice.message, allowed={"convert_currency"})] == ["convert_currency"]


def test_required_parallel_calls_all_valid(openai_client):
    messages = [{"role": "user", "content": "What is the weather in Paris, in Rome and in Oslo?"}]
    answer = create(openai_client, messages=messages, tool_choice="required", parallel_tool_calls=True, max_tokens=160)
    choice = answer.choices[0]
    calls = check_calls(choice.message, allowed=set(SCHEMAS))
    assert len(calls) >= 1
    # Either the model stopped after its calls, or ran out of tokens inside a further one.
    assert choice.finish_reason in ("tool_calls", "length")


@pytest.mark.parametrize(
    "prompt",
    ["What is the weather like in Paris right now?", "Write one sentence about the history of the violin."],
    ids=["tool_worthy", "no_tool_needed"],
)
def test_auto_gives_text_or_well_formed_calls(openai_client, prompt):
    answer = create(openai_client, messages=[{"role": "user", "content": prompt}], tool_choice="auto")
    choice = answer.choices[0]
    calls = check_calls(choice.message, allowed=set(SCHEMAS))
    if calls:
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.message.content and "<tool_call>" not in choice.message.content
        assert choice.finish_reason in ("stop", "length")


def test_tool_choice_none_is_plain_text(openai_client):
    answer = create(openai_client, messages=WEATHER_PROMPT, tool_choice="none", max_tokens=30)
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_streamed_tool_call_deltas_reassemble_to_the_whole_answer(openai_client):
    kwargs = {"messages": WEATHER_PROMPT, "tool_choice": "required", "parallel_tool_calls": False}
    whole = create(openai_client, **kwargs).choices[0].message
    stream = create(openai_client, stream=True, **kwargs)
    calls: dict[int, dict] = {}
    finish = []
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                if delta.id:
                    assert entry["id"] is None  # the id comes once, on the call's first delta
                    entry["id"] = delta.id
                    assert delta.type == "function"
                if delta.function and delta.function.name:
                    entry["name"] += delta.function.name
                if delta.function and delta.function.arguments:
                    entry["arguments"] += delta.function.arguments
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    assert finish == ["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_tool_result_turn_round_trip(openai_client):
    first = create(openai_client, messages=WEATHER_PROMPT, tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *WEATHER_PROMPT,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "conditions": "sunny"}'},
    ]
    answer = create(openai_client, messages=messages, tool_choice="none", max_tokens=30)
    assert answer.choices[0].message.content


BAD_TOOLS = [
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "send_email"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "bogus"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "multipleOf": 3}}}}}]}, "tools[0].function.parameters"),
    # arguments that never end: each `next` must hold another (the call could never be closed)
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}}}],
      "tool_choice": "auto"}, "tools[1].function.parameters"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_TOOLS)
def test_bad_tools_are_an_openai_400(openai_client, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body=fields,
        )
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
