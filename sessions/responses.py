"""Stored responses of the Responses API: the record, the store protocol and the in-process store.

A response is immutable once stored. Its record keeps what the next response
in a chain needs without reading its ancestors: `conversation`, the chat
messages every earlier response and this one added (its input, then its
answer; instructions are per response and never carried over). So a chain
is a linked list whose every node is whole: deleting a parent never breaks
a child, and two children of one parent (a branch) share nothing mutable.
Another tenant's response is reported as not found. The Redis store
(`response_redis_store.py`) has the same interface.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from loraplex.engine.errors import EngineError


class ResponseNotFoundError(EngineError):
    """Unknown, expired, deleted, not stored, or another tenant's response (never say which)."""

    code = "response_not_found"


def new_response_id() -> str:
    return f"resp_{secrets.token_hex(16)}"


@dataclass(slots=True)
class StoredResponse:
    id: str
    tenant_id: str
    model: str
    body: dict[str, Any]                         # the response object as the API returned it
    input_items: list[dict[str, Any]]            # this response's input items, with ids (GET .../input_items)
    conversation: list[dict[str, Any]]           # chat messages a continuation sees before its own input
    previous_response_id: str | None = None
    pin_key: str | None = None                   # the engine session key its KV is pinned under
    created_at: float = field(default_factory=time.time)
    expires_at: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> StoredResponse:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class ResponseStore(Protocol):
    def put(self, record: StoredResponse) -> None:
        """Store (or replace) a response until its `expires_at`."""

    def get(self, tenant_id: str, response_id: str) -> StoredResponse:
        """Raise ResponseNotFoundError for unknown, expired or other tenants' responses."""

    def delete(self, tenant_id: str, response_id: str) -> StoredResponse:
        """Remove at once; returns the removed record (its pin can then be released)."""


class MemoryResponseStore:
    """One process's responses (the default without Redis); expired records are dropped when touched."""

    def __init__(self) -> None:
        self._records: dict[str, StoredResponse] = {}
        self._lock = threading.Lock()

    def put(self, record: StoredResponse) -> None:
        with self._lock:
            self._drop_expired(time.time())
            self._records[record.id] = StoredResponse.from_json(record.to_json())

    def get(self, tenant_id: str, response_id: str) -> StoredResponse:
        with self._lock:
            record = self._live(tenant_id, response_id)
            return StoredResponse.from_json(record.to_json())

    def delete(self, tenant_id: str, response_id: str) -> StoredResponse:
        with self._lock:
            record = self._live(tenant_id, response_id)
            del self._records[response_id]
            return record

    def _live(self, tenant_id: str, response_id: str) -> StoredResponse:
        record = self._records.get(response_id)
        if record is None or record.tenant_id != tenant_id or record.expires_at <= time.time():
            raise ResponseNotFoundError(f"No response found with id '{response_id}'")
        return record

    def _drop_expired(self, now: float) -> None:
        for response_id in [r.id for r in self._records.values() if r.expires_at <= now]:
            del self._records[response_id]
