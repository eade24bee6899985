"""Thinking tokens through the real server and the openai client, with the trained `thinker` adapter.

The adapter answers `<think>...</think>` then the answer; the API must split
that into `reasoning_content` and content, count the reasoning tokens as the
engine did, honour thinking budgets, and bill them in the ledger.
"""

from __future__ import annotations

import openai
import pytest
from adapter_upload import upload_adapter
from loraplex.billing.models import UsageEventRow
from sqlalchemy import select

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
BUDGETS = {"reasoning_budget_low": 6, "reasoning_budget_medium": 256, "reasoning_budget_high": 1024}


def _reasoning(message_or_delta) -> str | None:
    return (message_or_delta.model_extra or {}).get("reasoning_content")


def _ledger(server) -> dict[str, UsageEventRow]:
    meter = next(r.meter for r in server.services.extensions.usage_recorders if hasattr(r, "meter"))
    assert meter.wait_written()
    with server.services.db_sessions() as db:
        return {row.request_id: row for row in db.scalars(select(UsageEventRow))}


@pytest.fixture(scope="module")
def server(start_server, smollm_path):
    from train_adapters import ensure_trained_adapters

    thinker = ensure_trained_adapters(smollm_path)["thinker"]
    with start_server(**BUDGETS) as running:
        upload_adapter(running, "thinker", thinker)
        yield running


def _chat(server, **kwargs):
    raw = server.client("all").chat.completions.with_raw_response.create(
        **{"model": "thinker", "messages": ASK, "max_tokens": 40, "temperature": 0, **kwargs})
    return raw.parse(), raw.headers["x-request-id"]


def test_reasoning_split_counted_and_billed(server):
    answer, request_id = _chat(server)
    message = answer.choices[0].message
    reasoning = _reasoning(message)
    assert reasoning and "user asks" in reasoning, message
    assert "<think>" not in message.content and "</think>" not in message.content and message.content.strip()
    assert "<think>" not in reasoning and "</think>" not in reasoning
    counted = answer.usage.completion_tokens_details.reasoning_tokens
    # The engine counts the marker tokens and everything between them; re-tokenizing the block agrees.
    tokenizer = server.services.tokenizer
    assert counted == len(tokenizer.encode(f"<think>{reasoning}</think>", add_special_tokens=False))
    assert counted < answer.usage.completion_tokens
    row = _ledger(server)[request_id]
    assert row.thinking_tokens == counted and row.output_tokens == answer.usage.completion_tokens


def test_streaming_reassembles_the_same_split(server):
    plain, _ = _chat(server)
    stream = server.client("all").chat.completions.create(
        model="thinker", messages=ASK, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True})
    reasoning, content, usage, reasoning_chunks = [], [], None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            part = _reasoning(choice.delta)
            if part:
                reasoning.append(part)
                reasoning_chunks += 1
            content.append(choice.delta.content or "")
    assert reasoning_chunks > 1  # streamed as it is generated, not in one piece at the end
    assert "".join(reasoning) == _reasoning(plain.choices[0].message)
    assert "".join(content) == plain.choices[0].message.content
    assert usage.completion_tokens_details.reasoning_tokens == plain.usage.completion_tokens_details.reasoning_tokens


def test_budget_closes_the_block_and_still_answers(server):
    end_len = len(server.services.tokenizer.encode("</think>", add_special_tokens=False))
    unbounded, _ = _chat(server)
    answer, _ = _chat(server, extra_body={"max_reasoning_tokens": 5})
    counted = answer.usage.completion_tokens_details.reasoning_tokens
    assert 0 < counted <= 5 + end_len < unbounded.usage.completion_tokens_details.reasoning_tokens
    assert _reasoning(answer.choices[0].message) is not None
    assert answer.choices[0].message.content.strip() and "think>" not in answer.choices[0].message.content


def test_reasoning_effort_maps_to_the_settings_budget(server):
    end_len = len(server.services.tokenizer.encode("</think>", add_special_tokens=False))
    low, _ = _chat(server, reasoning_effort="low")
    assert 0 < low.usage.completion_tokens_details.reasoning_tokens <= BUDGETS["reasoning_budget_low"] + end_len
    assert _reasoning(low.choices[0].message) and "think>" not in low.choices[0].message.content
    high, _ = _chat(server, reasoning_effort="high")
    unbounded, _ = _chat(server)
    assert (high.usage.completion_tokens_details.reasoning_tokens
            == unbounded.usage.completion_tokens_details.reasoning_tokens)
    # The explicit extension wins over the effort.
    both, _ = _chat(server, reasoning_effort="low", extra_body={"max_reasoning_tokens": 1024})
    assert both.usage.completion_tokens_details.reasoning_tokens == high.usage.completion_tokens_details.reasoning_tokens


@pytest.mark.parametrize(("field", "value"), [("reasoning_effort", "extreme"), ("max_reasoning_tokens", -1)])
def test_bad_budget_fields_are_400_naming_the_field(server, field, value):
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(server, extra_body={field: value})
    assert exc.value.body["param"] == field, exc.value.body


def test_base_model_without_markers_reports_zero(server):
    raw = server.client("all").chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK, max_tokens=20, temperature=0)
    answer = raw.parse()
    assert answer.usage.completion_tokens_details.reasoning_tokens == 0
    assert _reasoning(answer.choices[0].message) is None and answer.choices[0].message.content
    assert _ledger(server)[raw.headers["x-request-id"]].thinking_tokens == 0


def test_reasoning_format_none_leaves_the_text_alone(start_server, smollm_path):
    from train_adapters import ensure_trained_adapters

    with start_server(reasoning_format="none") as plain:
        upload_adapter(plain, "thinker", ensure_trained_adapters(smollm_path)["thinker"])
        answer, request_id = _chat(plain, reasoning_effort="low")  # accepted and ignored: nothing to budget
        assert answer.choices[0].message.content.startswith("<think>") and "</think>" in answer.choices[0].message.content
        assert _reasoning(answer.choices[0].message) is None
        assert answer.usage.completion_tokens_details.reasoning_tokens == 0
        assert _ledger(plain)[request_id].thinking_tokens == 0


def test_think_then_forced_tool_call(server):
    tools = [{"type": "function", "function": {
        "name": "capital_of", "parameters": {"type": "object", "properties": {"country": {"type": "string"}},
                                             "required": ["country"]}}}]
    answer, _ = _chat(server, tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=80,
                      reasoning_effort="high")  # structured output thinks first only when asked to
    choice = answer.choices[0]
    # The gate leaves a think block free, then the grammar forces the call; the tool parser sees only content.
    # Whether this out-of-distribution prompt (tools in the system prompt) makes the adapter think first varies
    # with prefix-cache numerics at temperature 0, so the test holds the split and the count to each other.
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "capital_of"
    assert "think>" not in (choice.message.content or "") + choice.message.tool_calls[0].function.arguments
    thought = _reasoning(choice.message)
    assert (answer.usage.completion_tokens_details.reasoning_tokens > 0) == bool(thought), (thought, answer.usage)
