"""Session state: the record, the store protocol, and the turn lease.

A session is a conversation the server remembers. Its record holds the
transcript (OpenAI messages, tool calls and results included), the defaults
its turns inherit, the token ids whose KV the engine keeps pinned, which
replica holds that KV and in what state, and a version that every completed
turn bumps by compare-and-set. A turn first takes the session's lease (one
turn at a time: a second gets SessionBusyError → 409) and appends to the
transcript only when it completes. Another tenant's session is reported as
not found. Two implementations: Redis (`RedisSessionStore`) and in-process
(`MemorySessionStore`).
"""

from __future__ import annotations

import builtins
import json
import secrets
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from loraplex.sessions.quota import NO_QUOTA, StoreQuota


class KVState:
    NONE = "none"            # no turn has run yet
    PINNED = "pinned"        # blocks held on the device
    OFFLOADED = "offloaded"  # copied to host memory under pressure; restored on the next turn
    DROPPED = "dropped"      # gone; the next turn re-prefills from the transcript

    ALL = frozenset({NONE, PINNED, OFFLOADED, DROPPED})


MAX_SESSION_ID_CHARS = 64


def new_session_id() -> str:
    return f"sess_{secrets.token_hex(12)}"


def is_session_id(session_id: str) -> bool:
    """Could a store have made this id? Ours are `sess_` and hex; any short id without ':' is let through
    (stores and tests may name their own), since ':' separates the parts of a Redis key."""
    return 0 < len(session_id) <= MAX_SESSION_ID_CHARS and ":" not in session_id and session_id.isprintable()


@dataclass(slots=True)
class SessionRecord:
    id: str
    tenant_id: str
    model: str                                   # what the client named: the base model or an adapter
    adapter_id: str | None = None
    system: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    ttl_seconds: int = 3600
    created_at: float = field(default_factory=time.time)
    expires_at: float = 0.0                      # unix time; pushed back by every turn
    messages: list[dict[str, Any]] = field(default_factory=list)
    prefix_token_ids: list[int] = field(default_factory=list)  # the last turn's prompt (its KV, and the answer's, pinned)
    replica_id: str | None = None
    version: int = 0
    kv_state: str = KVState.NONE
    num_turns: int = 0
    last_prompt_tokens: int = 0
    last_cached_tokens: int = 0
    last_output_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.expires_at:
            self.expires_at = self.created_at + self.ttl_seconds

    @property
    def num_tokens(self) -> int:
        """Tokens of the conversation so far: the last turn's prompt and its answer."""
        return len(self.prefix_token_ids) + self.last_output_tokens

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> SessionRecord:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(slots=True)
class TurnLease:
    """Held while a turn runs; `session` is the record as the turn began."""

    session: SessionRecord
    token: str = field(default_factory=lambda: secrets.token_hex(16))


@dataclass(slots=True)
class TurnResult:
    """What a completed turn adds to its session."""

    new_messages: list[dict[str, Any]]           # the turn's input messages, then the assistant's answer
    prefix_token_ids: list[int]                  # the turn's prompt token ids
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int = 0
    kv_state: str = KVState.PINNED
    replica_id: str | None = None


@dataclass(slots=True)
class SessionPage:
    data: list[SessionRecord]
    has_more: bool

    @property
    def first_id(self) -> str | None:
        return self.data[0].id if self.data else None

    @property
    def last_id(self) -> str | None:
        return self.data[-1].id if self.data else None


def apply_turn(record: SessionRecord, result: TurnResult, *, now: float) -> SessionRecord:
    """The record after a completed turn (a new object; the caller's stays as it was)."""
    updated = SessionRecord.from_json(record.to_json())
    updated.messages = [*record.messages, *result.new_messages]
    updated.prefix_token_ids = list(result.prefix_token_ids)
    updated.kv_state = result.kv_state
    updated.replica_id = result.replica_id
    updated.last_prompt_tokens = result.prompt_tokens
    updated.last_cached_tokens = result.cached_tokens
    updated.last_output_tokens = result.output_tokens
    updated.num_turns = record.num_turns + 1
    updated.version = record.version + 1
    updated.expires_at = now + record.ttl_seconds
    return updated


class SessionStore(Protocol):
    def create(self, record: SessionRecord, *, max_per_tenant: int = 0, quota: StoreQuota = NO_QUOTA) -> SessionRecord:
        """Store a new session (its TTL starts now); SessionLimitError if its tenant already has
        `max_per_tenant` live sessions (0: no cap), StoredState*Error past `quota`'s bytes caps (the record's
        own, the tenant's sum of its sessions' bytes). Counting and storing are one atomic step."""

    def bytes_of(self, tenant_id: str) -> int:
        """The bytes of the tenant's live sessions as stored (kept as a running total; expiry subtracts
        when the sweep retires an id)."""

    def get(self, tenant_id: str, session_id: str) -> SessionRecord:
        """Raise SessionNotFoundError for unknown, expired or other tenants' sessions."""

    def list(self, tenant_id: str, *, limit: int = 20, after: str | None = None) -> SessionPage:
        """The tenant's live sessions, newest first, `limit` after the cursor `after`."""

    def delete(self, tenant_id: str, session_id: str) -> SessionRecord:
        """Remove at once; returns the removed record so the caller can release its KV."""

    def begin_turn(self, tenant_id: str, session_id: str, *, lease_s: float = 600.0) -> TurnLease:
        """Take the session's lease (and push its expiry back); SessionBusyError if another turn holds it."""

    def complete_turn(self, lease: TurnLease, result: TurnResult) -> SessionRecord:
        """Append the turn (compare-and-set on version), refresh the TTL, release the lease.

        SessionConflictError if the lease was lost meanwhile; SessionNotFoundError
        if the session was deleted or expired during the turn.
        """

    def abort_turn(self, lease: TurnLease) -> None:
        """Release the lease without recording anything (the turn failed or the client left)."""

    def set_kv_state(self, session_id: str, kv_state: str) -> None:
        """The engine moved the session's blocks (offload, drop); no-op for a gone session."""

    def pop_expired(self, *, now: float | None = None) -> builtins.list[str]:
        """Ids of sessions that expired since the last call (each id returned once), to release their KV."""

    def alive(self, session_ids: builtins.list[str]) -> set[str]:
        """Which of these sessions still exist (any tenant): a replica releases the KV of the others."""
