"""Request bodies of /v1/chat/completions and /v1/completions.

Unknown fields are ignored (as OpenAI does); a wrong type is a 400 naming
the field (errors.install_error_handlers). Range checks live in
SamplingParams.validate so the engine and the API agree on them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _SamplingFields(_Body):
    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extensions beyond OpenAI (vLLM-compatible names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None  # token id (as a string, as JSON keys are) -> bias in [-100, 100]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Read by the grammar, sessions and reasoning preparers (see extensions.py)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    session_id: str | None = None
    reasoning_effort: str | None = None
    max_reasoning_tokens: int | None = None  # extension: thinking budget (tokens), wins over reasoning_effort


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # extension: the same structured output as chat
