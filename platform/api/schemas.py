"""Request bodies of /v1/chat/completions and /v1/completions.

Every top-level field is either declared here or screened by
param_policy.screen_fields: a parameter we cannot honour is a 400
`unsupported_parameter`, one no API defines a 400 `unknown_parameter`, never
silently ignored. Nested objects (messages, content parts) stay lenient,
since clients add their own bookkeeping there. A wrong type is a 400 naming
the field (errors.install_error_handlers). Range checks live in
SamplingParams.validate so the engine and the API agree on them; counts and
sizes a tenant controls are bounded by request_limits (settings-driven).
vLLM's extensions are translated by vllm_compat when the body is validated.
"""

from __future__ import annotations

from typing import Any, Literal

from loraplex.engine.errors import InvalidRequestError
from loraplex.platform.api.json_types import JSONBool, JSONFloat, JSONInt
from loraplex.platform.api.param_policy import check_harmless, screen_fields
from loraplex.platform.api.vllm_compat import structured_response_format
from pydantic import BaseModel, ConfigDict, Field, model_validator

# OpenAI asks for a stable end-user id; longer values would only bloat the ledger's index.
MAX_USER_CHARS = 256

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: JSONBool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: JSONFloat | None = None
    top_p: JSONFloat | None = None
    n: JSONInt = 1
    stop: str | list[str] | None = None
    seed: JSONInt | None = None
    presence_penalty: JSONFloat = 0.0
    frequency_penalty: JSONFloat = 0.0
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    stream: JSONBool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, JSONFloat] | None = None  # token id (as a string, as JSON keys are) -> bias in [-100, 100]
    response_format: dict[str, Any] | None = None
    # Accepted and harmless: nothing is stored, no tier is faster, the prefix cache needs no key.
    store: JSONBool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    # Extensions beyond OpenAI (vLLM-compatible names)
    top_k: JSONInt | None = None
    min_p: JSONFloat | None = None
    repetition_penalty: JSONFloat | None = None
    ignore_eos: JSONBool = False
    min_tokens: JSONInt | None = None
    stop_token_ids: list[JSONInt] | None = None
    include_stop_str_in_output: JSONBool = False
    skip_special_tokens: JSONBool = True
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: JSONInt = Field(default=0, ge=-(2**31), le=2**31 - 1)  # vLLM's: within the tenant, lower runs first

    @model_validator(mode="before")
    @classmethod
    def _screen_undeclared(cls, data: Any) -> Any:
        return screen_fields(data, declared=frozenset(cls.model_fields))

    @model_validator(mode="after")
    def _translate_extensions(self) -> _SamplingFields:
        check_harmless(service_tier=self.service_tier, modalities=getattr(self, "modalities", None),
                       metadata=self.metadata)
        response_format = structured_response_format(self)
        if response_format is not None:
            self.response_format = response_format
        max_tokens = self.explicit_max_tokens()
        if self.min_tokens is not None and max_tokens is not None and self.min_tokens > max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens})",
                                      param="min_tokens")
        return self

    def explicit_max_tokens(self) -> int | None:
        return getattr(self, "max_tokens", None)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: JSONInt | None = None
    max_completion_tokens: JSONInt | None = None
    logprobs: JSONBool = False
    top_logprobs: JSONInt | None = None
    # Read by the grammar, sessions and reasoning stages
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: JSONBool | None = None
    session_id: str | None = None
    reasoning_effort: ReasoningEffort | None = None
    max_reasoning_tokens: JSONInt | None = None  # extension: thinking budget (tokens), wins over reasoning_effort
    modalities: list[str] | None = None      # only ["text"]
    # vLLM's chat template controls
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: JSONBool | None = None
    continue_final_message: JSONBool = False

    def explicit_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[JSONInt] | list[list[JSONInt]]
    max_tokens: JSONInt | None = 16
    echo: JSONBool = False
    logprobs: JSONInt | None = None
    best_of: JSONInt | None = None
    suffix: str | None = None
