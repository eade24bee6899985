"""One Responses request as a chat completion: the conversation it continues, its input, its chat body.

The chat body goes through the same preparation as /v1/chat/completions
(quota, reasoning, structured output, chat template, admission); only the
engine session key that pins the response's KV is added after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.errors import InvalidRequestError
from loraplex.platform.api.schemas import ChatCompletionRequest
from loraplex.platform.responses.items import (
    ItemLimits,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    items_to_messages,
    normalize_input,
    public_format,
    public_tool_choice,
    public_tools,
)
from loraplex.platform.responses.schemas import ResponseCreate
from loraplex.sessions.responses import StoredResponse


@dataclass(slots=True)
class ResponseTurn:
    response_id: str
    body: ResponseCreate
    parent: StoredResponse | None
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]        # the chat messages this response continues (the parent's conversation)
    new_messages: list[dict[str, Any]]   # its input as chat messages
    created_at: int
    tools: list[dict[str, Any]] = field(default_factory=list)  # as kept: only the fields a function tool has
    tool_choice: str | dict[str, Any] | None = None
    num_dropped: int = 0                 # history messages left out by truncation="auto"
    stored: bool = False

    @classmethod
    def build(cls, response_id: str, body: ResponseCreate, parent: StoredResponse | None, created_at: int,
              limits: ItemLimits = ItemLimits()) -> ResponseTurn:
        items = normalize_input(body.input, limits)
        if parent is not None and parent.model != body.model:
            raise InvalidRequestError(
                f"previous response {parent.id} was made by model {parent.model!r}, not {body.model!r}", param="model")
        fmt = body.text.format if body.text else None
        if fmt is not None:
            if fmt.description is not None and len(fmt.description) > limits.max_description_chars:
                raise InvalidRequestError(f"text.format.description may hold at most {limits.max_description_chars} "
                                          "characters (max_description_chars)", param="text.format.description")
            if fmt.name is not None and len(fmt.name) > limits.max_id_chars:
                raise InvalidRequestError(f"text.format.name may hold at most {limits.max_id_chars} characters "
                                          "(max_item_id_chars)", param="text.format.name")
        return cls(response_id=response_id, body=body, parent=parent, input_items=items,
                   history=list(parent.conversation) if parent else [], new_messages=items_to_messages(items),
                   created_at=created_at, tools=public_tools(body.tools, limits),
                   tool_choice=public_tool_choice(body.tool_choice, limits))

    def messages(self) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": self.body.instructions}] if self.body.instructions else []
        return [*system, *self.history[self.num_dropped:], *self.new_messages]

    def can_truncate(self) -> bool:
        return self.body.truncation == "auto" and self.num_dropped < len(self.history)

    def drop_to(self, num_messages: int) -> None:
        """Leave out the first `num_messages` history messages (a turn boundary, from TurnCosts)."""
        self.num_dropped = min(len(self.history), max(self.num_dropped + 1, num_messages))

    def fit_messages(self, max_messages: int) -> None:
        """truncation="auto": leave out the oldest turns until the conversation holds at most `max_messages`."""
        fixed = len(self.new_messages) + (1 if self.body.instructions else 0)
        while self.can_truncate() and fixed + len(self.history) - self.num_dropped > max_messages:
            self.truncate()

    def truncate(self) -> None:
        """Leave out the oldest turn: history messages up to the next user message."""
        self.num_dropped += 1
        while self.num_dropped < len(self.history) and self.history[self.num_dropped]["role"] != "user":
            self.num_dropped += 1

    def chat_request(self) -> ChatCompletionRequest:
        body = self.body
        fmt = body.text.format if body.text else None
        fields: dict[str, Any] = {
            "model": body.model, "messages": self.messages(), "tools": chat_tools(self.tools),
            "tool_choice": chat_tool_choice(self.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": chat_response_format(fmt), "max_completion_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "user": body.user, "stream": body.stream,
            "reasoning_effort": body.reasoning.effort if body.reasoning else None,
        }
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})

    def conversation_after(self, output_items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """What a continuation of this response sees before its own input (instructions excluded)."""
        return [*self.history, *self.new_messages, *items_to_messages(output_items)]

    def public(self, *, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
               error: dict[str, Any] | None = None, incomplete_reason: str | None = None) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text else None
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": public_format(fmt), "verbosity": "medium"},
            "tool_choice": self.tool_choice or "auto", "tools": self.tools,
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": body.truncation or "disabled",
            "usage": usage, "user": body.user, "metadata": body.metadata or {},
        }


def responses_usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Chat-completions usage in the Responses API's names."""
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": chat_usage["completion_tokens_details"]["reasoning_tokens"]},
        "total_tokens": chat_usage["total_tokens"],
    }
