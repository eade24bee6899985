"""Stored responses of the Responses API: the record, the store protocol and the in-process store.

A response is immutable once stored. Its record keeps what the next response
in a chain needs without reading its ancestors: `conversation`, the chat
messages every earlier response and this one added (its input, then its
answer; instructions are per response and never carried over). So a chain
is a linked list whose every node is whole: deleting a parent never breaks
a child, and two children of one parent (a branch) share nothing mutable.
Another tenant's response is reported as not found. Each tenant's stored
responses are capped in count and bytes, and one record in size
(`StoreQuota`, checked atomically with the write). The Redis store
(`response_redis_store.py`) has the same interface.
"""

from __future__ import annotations

import heapq
import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from loraplex.engine.errors import DomainError
from loraplex.sessions.quota import NO_QUOTA, StoreQuota


class ResponseNotFoundError(DomainError):
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
    session_key: str | None = None               # the chain's affinity key (its first response's id)
    replica_id: str | None = None                # the replica whose engine holds the pinned KV
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
    def put(self, record: StoredResponse, *, quota: StoreQuota = NO_QUOTA) -> None:
        """Store (or replace) a response until its `expires_at`; refuse it past `quota` (its tenant's count and
        bytes, counted in the same atomic step)."""

    def usage(self, tenant_id: str) -> tuple[int, int]:
        """The tenant's live stored responses and their bytes."""

    def get(self, tenant_id: str, response_id: str) -> StoredResponse:
        """Raise ResponseNotFoundError for unknown, expired or other tenants' responses."""

    def delete(self, tenant_id: str, response_id: str) -> StoredResponse:
        """Remove at once; returns the removed record (its pin can then be released)."""

    def alive(self, response_ids: list[str]) -> set[str]:
        """Which of these responses are still stored (any tenant): a replica releases the pins of the others."""


@dataclass(slots=True)
class _Entry:
    tenant_id: str
    expires_at: float
    data: str
    num_bytes: int


class MemoryResponseStore:
    """One process's responses (the default without Redis). Records are kept as their JSON; each tenant's
    count and bytes are running totals, and expired records leave in expiry order (a heap), so saving one
    never walks the others."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._expiry: list[tuple[float, str]] = []
        self._usage: dict[str, list[int]] = {}  # tenant -> [count, bytes]
        self._lock = threading.Lock()

    def put(self, record: StoredResponse, *, quota: StoreQuota = NO_QUOTA) -> None:
        data = record.to_json()
        num_bytes = len(data.encode())
        quota.check_record(num_bytes)
        with self._lock:
            self._drop_expired(self._clock())
            count, used = self._usage.get(record.tenant_id, (0, 0))
            old = self._entries.get(record.id)
            if old is not None and old.tenant_id == record.tenant_id:
                count, used = count - 1, used - old.num_bytes
            quota.check(count=count, used_bytes=used, num_new_bytes=num_bytes)
            if old is not None:
                self._remove(record.id)
            self._entries[record.id] = _Entry(record.tenant_id, record.expires_at, data, num_bytes)
            usage = self._usage.setdefault(record.tenant_id, [0, 0])
            usage[0] += 1
            usage[1] += num_bytes
            heapq.heappush(self._expiry, (record.expires_at, record.id))

    def usage(self, tenant_id: str) -> tuple[int, int]:
        with self._lock:
            self._drop_expired(self._clock())
            count, used = self._usage.get(tenant_id, (0, 0))
            return count, used

    def get(self, tenant_id: str, response_id: str) -> StoredResponse:
        with self._lock:
            data = self._live(tenant_id, response_id).data
        return StoredResponse.from_json(data)

    def delete(self, tenant_id: str, response_id: str) -> StoredResponse:
        with self._lock:
            data = self._live(tenant_id, response_id).data
            self._remove(response_id)
        return StoredResponse.from_json(data)

    def alive(self, response_ids: list[str]) -> set[str]:
        with self._lock:
            self._drop_expired(self._clock())
            return {response_id for response_id in response_ids if response_id in self._entries}

    def _live(self, tenant_id: str, response_id: str) -> _Entry:
        entry = self._entries.get(response_id)
        if entry is None or entry.tenant_id != tenant_id or entry.expires_at <= self._clock():
            raise ResponseNotFoundError(f"No response found with id '{response_id[:80]}'")
        return entry

    def _remove(self, response_id: str) -> None:
        entry = self._entries.pop(response_id)
        usage = self._usage[entry.tenant_id]
        usage[0] -= 1
        usage[1] -= entry.num_bytes
        if not usage[0]:
            del self._usage[entry.tenant_id]

    def _drop_expired(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, response_id = heapq.heappop(self._expiry)
            entry = self._entries.get(response_id)
            if entry is not None and entry.expires_at == expires_at:  # not replaced since with a later expiry
                self._remove(response_id)
