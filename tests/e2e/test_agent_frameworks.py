"""Agent frameworks as their users run them, against a real server: LangChain, Instructor, pydantic-ai.

Each sends what it sends by default (we refuse unknown parameters, so these
tests are what proves the frameworks' defaults are accepted). The model is
SmolLM2-135M; our grammars force the tool calls and JSON, so structured
results validate. Tracing and telemetry stay off: nothing leaves this machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from e2e_helpers import MODEL
from pydantic import BaseModel, Field


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int


class Weather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=24)


PROMPT = "Extract the person: Ada Lovelace was 36 years old."


@pytest.fixture(autouse=True)
def no_telemetry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGSMITH_TRACING_V2"):
        monkeypatch.setenv(name, "false")
    monkeypatch.delenv("LANGSMITH_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    yield


def _base_url(api_server: Any) -> str:
    return api_server.base_url + "/v1"


# ---- LangChain ------------------------------------------------------------------------------------

def _chat_openai(api_server: Any, **kwargs: Any) -> Any:
    from langchain_openai import ChatOpenAI

    # A timeout as any production client sets one: a request that never answers fails the test, not the suite.
    return ChatOpenAI(model=MODEL, base_url=_base_url(api_server), api_key=api_server.keys["all"],
                      temperature=0, max_retries=0, timeout=120, **kwargs)


def test_langchain_invoke_and_stream(api_server) -> None:  # type: ignore[no-untyped-def]
    llm = _chat_openai(api_server, max_tokens=12)
    answer = llm.invoke("Name three colours.")
    assert answer.content and answer.usage_metadata["output_tokens"] >= 1
    chunks = list(_chat_openai(api_server, max_tokens=12, stream_usage=True).stream("Name three colours."))
    assert "".join(c.content for c in chunks) == answer.content
    assert any(c.usage_metadata for c in chunks)


def test_langchain_bind_tools(api_server) -> None:  # type: ignore[no-untyped-def]
    llm = _chat_openai(api_server, max_tokens=60).bind_tools([Weather], tool_choice="Weather")
    message = llm.invoke("What is the weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "Weather"
    assert Weather.model_validate(call["args"]).city
    # The agent loop's second half: the tool's result goes back as a `tool` message, the model answers.
    from langchain_core.messages import HumanMessage, ToolMessage

    answer = _chat_openai(api_server, max_tokens=20).invoke([
        HumanMessage("What is the weather in Paris?"), message,
        ToolMessage("Sunny, 21 degrees.", tool_call_id=call["id"]),
    ])
    assert answer.content and not answer.tool_calls


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(api_server, method) -> None:  # type: ignore[no-untyped-def]
    llm = _chat_openai(api_server, max_tokens=80)
    structured = llm.with_structured_output(Person, method=method)
    prompt = PROMPT if method != "json_mode" else PROMPT + " Reply in JSON with keys name and age."
    if method == "json_mode":
        # json_mode only promises some JSON object (as on OpenAI): the model decides the keys.
        raw = llm.with_structured_output(None, method="json_mode", include_raw=True).invoke(prompt)
        assert raw["parsing_error"] is None and isinstance(raw["parsed"], dict)
        return
    person = structured.invoke(prompt)
    assert isinstance(person, Person) and person.name


# ---- Instructor ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_response_model(api_server, mode) -> None:  # type: ignore[no-untyped-def]
    import instructor

    client = instructor.from_openai(
        openai.OpenAI(base_url=_base_url(api_server), api_key=api_server.keys["all"], max_retries=0, timeout=120),
        mode=getattr(instructor.Mode, mode),
    )
    person = client.chat.completions.create(model=MODEL, response_model=Person, max_retries=0, max_tokens=80,
                                            temperature=0, messages=[{"role": "user", "content": PROMPT}])
    assert isinstance(person, Person) and person.name


# ---- pydantic-ai -------------------------------------------------------------------------------------

def _agent(api_server: Any, **kwargs: Any) -> Any:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(openai_client=openai.AsyncOpenAI(
        base_url=_base_url(api_server), api_key=api_server.keys["all"], max_retries=0, timeout=120))
    return Agent(OpenAIChatModel(MODEL, provider=provider),
                 model_settings={"max_tokens": 80, "temperature": 0}, **kwargs)


def test_pydantic_ai_text(api_server) -> None:  # type: ignore[no-untyped-def]
    result = _agent(api_server).run_sync("Name three colours.")
    assert isinstance(result.output, str) and result.output
    assert result.usage().output_tokens >= 1


def test_pydantic_ai_structured_output(api_server) -> None:  # type: ignore[no-untyped-def]
    result = _agent(api_server, output_type=Person).run_sync(PROMPT)
    assert isinstance(result.output, Person) and result.output.name


def test_pydantic_ai_conversation_with_tool_messages(api_server) -> None:  # type: ignore[no-untyped-def]
    """A structured run ends in a tool call and its `tool` reply; the next run sends that history back."""
    first = _agent(api_server, output_type=Person).run_sync(PROMPT)
    history = first.all_messages()
    assert any(getattr(part, "part_kind", "") == "tool-return" for message in history for part in message.parts)
    follow_up = _agent(api_server).run_sync("Say OK.", message_history=history)
    assert isinstance(follow_up.output, str) and follow_up.output
