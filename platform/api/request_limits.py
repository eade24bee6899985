"""Counts and sizes a tenant controls in one request body, bounded before any work is done on them.

Each limit is a Settings field; a body past one is a 400 naming the
parameter, so a hostile tenant cannot make the server scan a million stop
strings per token or template ten thousand messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.engine.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_stop_sequences: int = 4          # OpenAI's limit
    max_stop_sequence_chars: int = 256
    max_stop_token_ids: int = 64
    max_logit_bias_entries: int = 300    # OpenAI's limit
    max_n: int = 16
    max_messages: int = 2048
    max_prompts: int = 256

    @classmethod
    def from_settings(cls, settings: Any) -> RequestLimits:
        return cls(
            max_stop_sequences=settings.max_stop_sequences,
            max_stop_sequence_chars=settings.max_stop_sequence_chars,
            max_stop_token_ids=settings.max_stop_token_ids,
            max_logit_bias_entries=settings.max_logit_bias_entries,
            max_n=settings.max_n,
            max_messages=settings.max_messages,
            max_prompts=settings.max_prompts,
        )


def check_request_limits(body: Any, limits: RequestLimits) -> None:
    """Raise InvalidRequestError naming the first parameter past its limit."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    _at_most(len(stop), limits.max_stop_sequences, "stop", "stop sequences")
    if any(len(s) > limits.max_stop_sequence_chars for s in stop):
        raise InvalidRequestError(
            f"each stop sequence may be at most {limits.max_stop_sequence_chars} characters", param="stop"
        )
    _at_most(len(body.stop_token_ids or []), limits.max_stop_token_ids, "stop_token_ids", "stop token ids")
    _at_most(len(body.logit_bias or {}), limits.max_logit_bias_entries, "logit_bias", "entries")
    _at_most(body.n, limits.max_n, "n", "choices")
    messages = getattr(body, "messages", None)
    if messages is not None:
        _at_most(len(messages), limits.max_messages, "messages", "messages")
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        _at_most(len(prompt), limits.max_prompts, "prompt", "prompts")


def _at_most(count: int, limit: int, param: str, what: str) -> None:
    if count > limit:
        raise InvalidRequestError(f"{param} allows at most {limit} {what}; got {count}", param=param)
