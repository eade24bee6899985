"""The body of POST /v1/responses: what we honour, what is harmless, and what is refused by name.

Like the chat schema (api/schemas.py), nothing is silently ignored: a Responses
feature we do not provide (built-in tools, background mode, reusable prompts,
conversations...) is a 400 `unsupported_parameter` naming it, an unknown field
a 400 `unknown_parameter`. Input items and tools are validated where they are
converted (items.py), so their errors can name the exact element.
"""

from __future__ import annotations

from typing import Any, Literal

from loraplex.platform.api.json_types import JSONBool, JSONFloat, JSONInt
from loraplex.platform.api.param_policy import (
    UnknownParameterError,
    UnsupportedParameterError,
    check_harmless,
)
from loraplex.platform.api.schemas import MAX_USER_CHARS, ReasoningEffort
from pydantic import BaseModel, ConfigDict, Field, model_validator

# Responses parameters we cannot honour: refused when given a value that asks for something.
REFUSED: dict[str, str] = {
    "background": "background mode is not supported; stream the response instead",
    "conversation": "the Conversations API is not supported; chain responses with previous_response_id",
    "prompt": "reusable prompt templates are not supported; send instructions and input",
    "max_tool_calls": "max_tool_calls is not supported",
    "context_management": "context_management is not supported; use truncation",
}

# What a refused parameter may be set to and still ask for nothing (the SDKs send some of these).
_NOTHING: tuple[object, ...] = (None, False, [], {})


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: JSONBool | None = None
    description: str | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one we do not have to pretend to honour


class ReasoningConfig(_Lenient):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # the whole reasoning text is returned
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(_Lenient):
    include_obfuscation: JSONBool | None = None  # no obfuscation padding is ever sent


class ResponseCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: JSONBool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: JSONBool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: JSONInt | None = Field(default=None, ge=1)
    temperature: JSONFloat | None = None
    top_p: JSONFloat | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    stream: JSONBool = False
    stream_options: StreamOptions | None = None
    include: list[str] | None = None
    top_logprobs: JSONInt | None = Field(default=None, ge=0)  # logprobs are not returned here: only 0 passes (_check)
    # Accepted and harmless: no tier is faster, the prefix cache needs no key.
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        screened = {}
        for name, value in data.items():
            if name in REFUSED:
                if value not in _NOTHING:
                    raise UnsupportedParameterError(f"{name}: {REFUSED[name]}", param=name)
            elif name in cls.model_fields:
                screened[name] = value
            else:
                raise UnknownParameterError(f"Unrecognized request argument supplied: {name}", param=name)
        return screened

    @model_validator(mode="after")
    def _check(self) -> ResponseCreate:
        check_harmless(service_tier=self.service_tier, modalities=None, metadata=self.metadata)
        if self.include:
            # Reasoning comes back in the clear (reasoning items); no other output can be included.
            raise UnsupportedParameterError(f"include {self.include[0]!r} is not supported", param="include")
        if self.top_logprobs:
            raise UnsupportedParameterError("top_logprobs: log probabilities are not returned by /v1/responses; "
                                            "ask /v1/chat/completions with logprobs and top_logprobs",
                                            param="top_logprobs")
        return self
