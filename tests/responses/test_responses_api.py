"""The Responses API through the real server and the official openai client (SmolLM2, greedy)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16  # the engine's KV block: pinned KV covers whole blocks only

QUESTIONS = [
    "My name is Ada. Remember it.", "What is 2 plus 3?", "Name a colour of the sky.", "What is my name?",
    "Say a word that rhymes with cat.", "Which is bigger, 7 or 9?", "Name a fruit.", "What is the capital of France?",
    "Count from one to three.", "Say goodbye.",
]
INSTRUCTIONS = "You are a terse assistant."
WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "Current weather of a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False},
}


def _pins(server) -> dict:
    return server.services.engine.engine.block_manager.pins


def _engine_counters(server) -> tuple[int, int]:
    stats = server.services.engine.stats()
    return stats["prompt_tokens_total"], stats["prefix_cache_hits"]


def test_single_response_is_stored_retrievable_and_deletable(server):
    client = server.client("all")
    response = client.responses.create(model=MODEL, input="Say hello.", instructions=INSTRUCTIONS,
                                       max_output_tokens=12, temperature=0, metadata={"case": "single"})
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete") and response.output_text
    message = response.output[-1]
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].text == response.output_text
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert response.metadata == {"case": "single"} and response.instructions == INSTRUCTIONS

    fetched = client.responses.retrieve(response.id)
    assert fetched.output_text == response.output_text and fetched.usage == response.usage
    items = client.responses.input_items.list(response.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Say hello.")]

    deleted = httpx.delete(f"{server.base_url}/v1/responses/{response.id}",
                           headers={"Authorization": f"Bearer {server.keys['all']}"}, timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    # its KV is let go on the engine loop's next step
    wait_until(lambda: response.id not in _pins(server), timeout_s=5, what="the response's pinned KV to be released")


def test_stream_events_in_order_and_text_equal_to_whole_response(server):
    client = server.client("all")
    kwargs = {"model": MODEL, "input": "Write one short sentence about the sea.", "max_output_tokens": 24,
              "temperature": 0}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    final = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", final]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    assert events[-1].response.output_text == text and events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(events[-1].response.id).output_text == text


def test_ten_turn_chain_equals_stateless_and_prefills_only_new_tokens(server):
    client = server.client("all")
    stateless = server.client("globex")  # another tenant: its prefix cache can never serve the chain
    history: list[dict] = []
    previous = None
    previous_total = None
    for turn, question in enumerate(QUESTIONS, start=1):
        user = {"role": "user", "content": question}
        prompt_before, hits_before = _engine_counters(server)
        response = client.responses.create(model=MODEL, input=question, instructions=INSTRUCTIONS,
                                           previous_response_id=previous, max_output_tokens=12, temperature=0)
        prompt_after, hits_after = _engine_counters(server)
        reference = stateless.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": INSTRUCTIONS}, *history, user], max_tokens=12,
            temperature=0)
        assert response.output_text == reference.choices[0].message.content, f"turn {turn}"
        usage = response.usage
        assert usage.input_tokens == reference.usage.prompt_tokens
        prefilled = prompt_after - prompt_before - (hits_after - hits_before)  # what the engine computed
        assert prefilled == usage.input_tokens - usage.input_tokens_details.cached_tokens
        if previous_total is not None:
            new_tokens = usage.input_tokens - previous_total
            # Only the new tokens, plus the tail of the last partly filled block (pins hold whole blocks).
            assert new_tokens <= prefilled <= new_tokens + BLOCK_SIZE, (turn, prefilled, new_tokens)
        previous_total = usage.input_tokens + usage.output_tokens
        history += [user, {"role": "assistant", "content": response.output_text}]
        previous = response.id
    # The same conversation sent statelessly through the Responses API gives the same tenth answer.
    items = [{"role": m["role"], "content": m["content"]} for m in history[:-1]]
    again = stateless.responses.create(model=MODEL, input=items, instructions=INSTRUCTIONS, max_output_tokens=12,
                                       temperature=0, store=False)
    assert again.output_text == history[-1]["content"]
    assert previous in _pins(server)


def test_two_branches_from_one_parent_are_each_exact(server):
    client = server.client("all")
    stateless = server.client("globex")
    root = client.responses.create(model=MODEL, input="My favourite number is 7.", max_output_tokens=10, temperature=0)
    first_turn = [{"role": "user", "content": "My favourite number is 7."},
                  {"role": "assistant", "content": root.output_text}]
    for question in ["What is my favourite number?", "Double my favourite number."]:
        branch = client.responses.create(model=MODEL, input=question, previous_response_id=root.id,
                                         max_output_tokens=10, temperature=0)
        reference = stateless.chat.completions.create(
            model=MODEL, messages=[*first_turn, {"role": "user", "content": question}], max_tokens=10, temperature=0)
        assert branch.output_text == reference.choices[0].message.content
        assert branch.usage.input_tokens_details.cached_tokens >= BLOCK_SIZE  # the shared prefix came from KV


def test_function_call_round_trip(server):
    client = server.client("all")
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER_TOOL],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=64,
                                    temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    arguments = json.loads(calls[0].arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["parameters"])
    assert first.parallel_tool_calls is False
    answer = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER_TOOL], max_output_tokens=24, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "sunny", "c": 21}'}])
    assert answer.output[-1].type == "message" and answer.output_text
    items = client.responses.input_items.list(answer.id, order="asc").data
    assert [(i.type, i.call_id) for i in items] == [("function_call_output", calls[0].call_id)]
    # Stateless: the same items sent back give the same answer.
    stateless = server.client("globex").responses.create(
        model=MODEL, tools=[WEATHER_TOOL], max_output_tokens=24, temperature=0, store=False,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "sunny", "c": 21}'}])
    assert stateless.output_text == answer.output_text


def test_streamed_function_call_events(server):
    client = server.client("all")
    events = list(client.responses.create(model=MODEL, input="Weather in Rome?", tools=[WEATHER_TOOL],
                                          tool_choice="required", max_output_tokens=64, temperature=0, stream=True,
                                          parallel_tool_calls=False))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2].item.type == "function_call"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                     and e.item_id == done.item_id)
    assert deltas == done.arguments and json.loads(done.arguments)["city"]
    assert types[-2:] == ["response.output_item.done", "response.completed"]
    assert events[-1].response.output[0].call_id == events[2].item.call_id


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "name": "person", "strict": True, "schema": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}},
    {"type": "json_object"},
])
def test_structured_output_via_text_format(server, fmt):
    client = server.client("all")
    response = client.responses.create(model=MODEL, input="Describe a person as JSON.", text={"format": fmt},
                                       max_output_tokens=60, temperature=0)
    value = json.loads(response.output_text)  # near the budget's end, generation is steered to close the JSON
    if fmt["type"] == "json_schema":
        assert response.status == "completed"
        jsonschema.validate(value, fmt["schema"])
        assert response.text.format.type == "json_schema"
    else:
        assert isinstance(value, dict)


def test_other_tenants_responses_are_not_found(server):
    client = server.client("all")
    mine = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=4, temperature=0)
    other = server.client("globex")
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError) as refused:
        other.responses.create(model=MODEL, input="Go on.", previous_response_id=mine.id, max_output_tokens=4)
    assert refused.value.body["param"] == "previous_response_id"
    assert client.responses.retrieve(mine.id).output_text == mine.output_text  # untouched


def test_unstored_response_cannot_be_retrieved_or_continued(server):
    client = server.client("all")
    response = client.responses.create(model=MODEL, input="Hi.", store=False, max_output_tokens=4, temperature=0)
    assert response.store is False and response.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="More.", previous_response_id=response.id, max_output_tokens=4)


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"top_logprobs": 5}, "top_logprobs"),
])
def test_unsupported_features_are_refused_by_name(server, extra, param):
    body = {"model": MODEL, "input": "Hi.", **extra}
    response = httpx.post(f"{server.base_url}/v1/responses", json=body,
                          headers={"Authorization": f"Bearer {server.keys['all']}"}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_each_response_is_one_usage_event(server):
    client = server.client("all")
    first = client.responses.create(model=MODEL, input="Name a planet.", max_output_tokens=8, temperature=0)
    second = client.responses.create(model=MODEL, input="Another one.", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    headers = {"Authorization": f"Bearer {server.keys['all']}"}
    request_id = "req_" + second.id.removeprefix("resp_")

    def usage_row() -> dict | None:
        row = httpx.get(f"{server.base_url}/v1/usage/requests/{request_id}", headers=headers, timeout=30)
        return row.json() if row.status_code == 200 else None

    event = wait_until(usage_row, timeout_s=15, interval_s=0.2, what=f"the usage row of {request_id}")
    assert event["session_id"] == second.id
    assert event["input_tokens"] == second.usage.input_tokens
    assert event["cached_input_tokens"] == second.usage.input_tokens_details.cached_tokens > 0
    assert event["output_tokens"] == second.usage.output_tokens


def test_reasoning_effort_is_the_thinking_budget(server):
    client = server.client("all")
    response = client.responses.create(model=MODEL, input="Is 17 prime?", reasoning={"effort": "low"},
                                       max_output_tokens=48, temperature=0)
    assert response.reasoning.effort == "low"
    budget = server.settings.reasoning_budget_low
    assert 0 <= response.usage.output_tokens_details.reasoning_tokens <= budget
    thinking = [item for item in response.output if item.type == "reasoning"]
    if response.usage.output_tokens_details.reasoning_tokens:  # the model thought: it comes back as an item
        assert thinking and thinking[0].content[0].text
    else:
        assert not thinking


def test_an_output_limit_past_the_context_names_max_output_tokens(server):
    """The chat preparation underneath knows the limit as max_tokens: a Responses client sees its own field's
    name, in the param and in the message."""
    context = server.services.engine.max_model_len
    with pytest.raises(openai.BadRequestError) as refused:
        server.client("all").responses.create(model=MODEL, input="Hi.", max_output_tokens=context + 10)
    error = refused.value.body
    assert refused.value.code == "context_length_exceeded" and error["param"] == "max_output_tokens"
    assert "max_output_tokens" in error["message"]
    assert "max_tokens" not in error["message"] and "max_completion_tokens" not in error["message"]
    with pytest.raises(openai.BadRequestError) as truncating:  # leaving turns out cannot make room for it either
        server.client("all").responses.create(model=MODEL, input="Hi.", max_output_tokens=context + 10,
                                              truncation="auto")
    assert truncating.value.body["param"] == "max_output_tokens"


def test_truncation_auto_leaves_out_the_oldest_turns(server):
    client = server.client("all")
    notes = " ".join(f"note {i} about rivers and bridges;" for i in range(120))  # ~1,150 tokens
    first = client.responses.create(model=MODEL, input=notes, max_output_tokens=4, temperature=0)
    follow_up = " ".join(f"detail {i} about harbours;" for i in range(150))    # ~1,050 tokens: past the context
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input=follow_up, previous_response_id=first.id, max_output_tokens=4)
    assert refused.value.code == "context_length_exceeded" and refused.value.body["param"] == "input"
    kept = client.responses.create(model=MODEL, input=follow_up, previous_response_id=first.id,
                                   truncation="auto", max_output_tokens=4, temperature=0)
    context = server.services.engine.max_model_len
    # The first turn was left out: what was sent fits, with it the conversation would not.
    assert kept.truncation == "auto" and kept.usage.input_tokens < context < kept.usage.input_tokens + first.usage.input_tokens
