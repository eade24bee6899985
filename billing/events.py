"""The usage event: what one request consumed, as the platform reports it at the request's end.

Token accounting follows the OpenAI usage object: `input_tokens` counts every
prompt token and `cached_input_tokens` is the part of it whose KV came from
the prefix cache or a session; `output_tokens` counts every generated token
of every choice and `thinking_tokens` is the part of it inside the reasoning
segment. Cost is not part of the event: the ledger prices it with the price
in force at `created_at`, so an event spooled while the database was down is
priced exactly as it would have been on time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from typing import Any


class UsageStatus:
    COMPLETED = "completed"  # finished on its own (EOS, grammar end)
    STOPPED = "stopped"      # ended by a caller-given stop string or stop token
    LENGTH = "length"        # cut by max_tokens or the context length
    ABORTED = "aborted"      # the client went away (or the server shut down) mid-request
    FAILED = "failed"        # failed after it started

    ALL = frozenset({COMPLETED, STOPPED, LENGTH, ABORTED, FAILED})


@dataclass(slots=True)
class UsageEvent:
    request_id: str
    tenant_id: str
    model: str
    status: str
    created_at: datetime                 # when the request arrived (UTC); picks the price and the day
    api_key_id: str | None = None
    adapter_id: str | None = None        # None: the base model
    session_id: str | None = None
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    thinking_tokens: int = 0
    ttft_ms: float | None = None         # None when no token was produced
    duration_ms: float = 0.0
    user: str | None = None              # the caller's end-user id (OpenAI's `user` field), if it sent one
    batch_id: str | None = None          # the batch this request is a line of: priced at the batch price

    def __post_init__(self) -> None:
        if self.status not in UsageStatus.ALL:
            raise ValueError(f"unknown usage status {self.status!r}")
        if self.created_at.tzinfo is None:
            raise ValueError("created_at must be timezone-aware")
        if not 0 <= self.cached_input_tokens <= self.input_tokens:
            raise ValueError("cached_input_tokens must be within input_tokens")
        if not 0 <= self.thinking_tokens <= self.output_tokens:
            raise ValueError("thinking_tokens must be within output_tokens")

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def to_json(self) -> str:
        data: dict[str, Any] = asdict(self)
        data["created_at"] = self.created_at.astimezone(UTC).isoformat()
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> UsageEvent:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data["created_at"] = datetime.fromisoformat(data["created_at"])
        return cls(**data)
