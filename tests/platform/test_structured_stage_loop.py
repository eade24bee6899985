"""A tenant's large schema is checked off the event loop: other requests and streams on the API server keep
moving while it is (checking one near the size limits against its metaschema takes seconds of CPU)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.protocol import SamplingParams
from loraplex.platform.api.schemas import ChatCompletionRequest
from loraplex.platform.extensions import PreparedRequest, ServedModel
from loraplex.platform.structured import build_structured_output

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stage(smollm_path: Any) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm_path)
    built = build_structured_output(tokenizer, len(tokenizer))
    yield built
    built.compiler.close()


def _prepared(**body: Any) -> PreparedRequest:
    messages = [{"role": "user", "content": "hi"}]
    request = ChatCompletionRequest(model=MODEL, messages=messages, **body)
    return PreparedRequest(request_id="req-1", kind="chat", tenant_id="t1", key_id="k1", body=request,
                           model=ServedModel(id=MODEL), sampling=SamplingParams(max_tokens=8), messages=messages)


async def _longest_pause_while(work: Any) -> tuple[float, BaseException | None]:
    longest, last, done = 0.0, time.perf_counter(), False

    async def heartbeat() -> None:
        nonlocal longest, last
        while not done:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.02)  # beating
    try:
        await work
        error = None
    except InvalidRequestError as exc:
        error = exc
    longest = max(longest, time.perf_counter() - last)  # the pause up to now, had the work never yielded
    done = True
    await beat
    return longest, error


def test_a_large_schema_never_holds_the_event_loop(stage: Any) -> None:
    # 3,000 properties and one that cannot be satisfied: seconds of metaschema checking, then a 400 (no compile)
    properties: dict[str, Any] = {f"p{i}": {"type": "string", "minLength": 1} for i in range(3_000)}
    schema = {"type": "object", "properties": {**properties, "p0": False}, "required": ["p0"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    started = time.perf_counter()
    longest, error = asyncio.run(_longest_pause_while(stage(_prepared(response_format=response_format))))
    took = time.perf_counter() - started
    assert isinstance(error, InvalidRequestError) and "cannot be satisfied" in error.message
    assert error.param == "response_format.json_schema.schema"
    assert took > 0.3, "the check was too quick to tell whether it held the loop"
    assert longest < 0.25, f"the event loop stood still for {longest:.2f}s of a {took:.2f}s check"


def test_tools_past_the_spec_size_are_refused_before_any_schema_is_checked(stage: Any) -> None:
    parameters = {"type": "object", "properties": {f"p{j}": {"type": "string", "minLength": 1} for j in range(2_000)}}
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": parameters}} for i in range(60)]
    started = time.perf_counter()
    _, error = asyncio.run(_longest_pause_while(stage(_prepared(tools=tools))))
    assert isinstance(error, InvalidRequestError) and error.param == "tools"
    assert "bytes as JSON" in error.message
    assert time.perf_counter() - started < 1.0  # 120,000 subschemas were never walked (about a minute of checks)
