"""Running one session turn, independent of the web framework.

`SessionTurns.begin` takes the session's lease and says which messages the
model sees (system prompt + transcript + the new messages); `AnswerCapture`
wraps the choice's message parser so the assistant message the client
received (content and tool calls) can be appended; `complete` / `abort`
end the turn. The replica remembers which sessions it pinned KV for, and
`sweep` releases the KV of those that expired or were deleted elsewhere.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from loraplex.sessions.errors import SessionBusyError
from loraplex.sessions.quota import NO_QUOTA, StoreQuota
from loraplex.sessions.store import KVState, SessionRecord, SessionStore, TurnLease, TurnResult


class MessageParts(Protocol):
    content: str
    reasoning_content: str
    tool_calls: list[dict[str, Any]]


class Parser(Protocol):
    def feed(self, text: str) -> Any: ...
    def finish(self, finish_reason: str) -> tuple[Any, str]: ...


class AnswerCapture:
    """A message parser that passes everything through and keeps the assistant message it produced."""

    def __init__(self, parser: Parser) -> None:
        self._parser = parser
        self._content: list[str] = []
        self._tool_calls: list[dict[str, Any]] = []
        self.finish_reason: str | None = None

    def feed(self, text: str) -> Any:
        delta = self._parser.feed(text)
        self._add(delta)
        return delta

    def finish(self, finish_reason: str) -> tuple[Any, str]:
        delta, reason = self._parser.finish(finish_reason)
        self._add(delta)
        self.finish_reason = reason
        return delta, reason

    def message(self) -> dict[str, Any]:
        """As the API returned it; reasoning is not part of the transcript (clients don't send it back)."""
        content = "".join(self._content)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not self._tool_calls else None}
        if self._tool_calls:
            message["tool_calls"] = self._tool_calls
        return message

    def _add(self, delta: MessageParts) -> None:
        if delta.content:
            self._content.append(delta.content)
        for part in delta.tool_calls or []:
            index = part.get("index", len(self._tool_calls))
            while len(self._tool_calls) <= index:
                self._tool_calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            call = self._tool_calls[index]
            call["id"] = part.get("id") or call["id"]
            function = part.get("function") or {}
            call["function"]["name"] += function.get("name") or ""
            call["function"]["arguments"] += function.get("arguments") or ""


def conversation(session: SessionRecord, new_messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the model sees this turn: the session's system prompt, its transcript, then the new messages."""
    system = [{"role": "system", "content": session.system}] if session.system else []
    return [*system, *session.messages, *new_messages]


@dataclass(slots=True)
class SessionStats:
    num_turns: int = 0
    num_turn_prompt_tokens: int = 0
    num_turn_cached_tokens: int = 0
    num_released: int = 0

    @property
    def cache_hit_rate(self) -> float:
        return self.num_turn_cached_tokens / self.num_turn_prompt_tokens if self.num_turn_prompt_tokens else 0.0


@dataclass(slots=True)
class OpenTurn:
    """One running turn: its lease, the client's new messages, and the answer being captured."""

    lease: TurnLease
    new_messages: list[dict[str, Any]]
    capture: AnswerCapture | None = None
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class SessionTurns:
    def __init__(self, store: SessionStore, *, replica_id: str, lease_s: float,
                 release: Callable[[str], None], busy_wait_s: float = 1.0, quota: StoreQuota = NO_QUOTA) -> None:
        self.store = store
        self.quota = quota  # bytes: one session's record, and the sum of a tenant's (checked as each turn begins)
        self.replica_id = replica_id
        self.lease_s = lease_s
        self.busy_wait_s = busy_wait_s
        self._release = release
        self._pinned_here: set[str] = set()
        self._lock = threading.Lock()
        self.stats = SessionStats()

    @property
    def num_pinned_here(self) -> int:
        return len(self._pinned_here)

    def begin(self, tenant_id: str, session_id: str, new_messages: list[dict[str, Any]]) -> OpenTurn:
        """Take the lease, waiting up to `busy_wait_s` for a turn that is just finishing.

        A streamed turn is recorded right after its last chunk is sent, so a client
        that sends the next turn at once would otherwise race the previous one's end.
        """
        deadline = time.monotonic() + self.busy_wait_s
        while True:
            try:
                lease = self.store.begin_turn(tenant_id, session_id, lease_s=self.lease_s)
                break
            except SessionBusyError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.02)
        try:
            self._check_room(lease, new_messages)
        except BaseException:
            self.store.abort_turn(lease)
            raise
        return OpenTurn(lease=lease, new_messages=new_messages)

    def _check_room(self, lease: TurnLease, new_messages: list[dict[str, Any]]) -> None:
        """A turn that would grow its session past `quota` is refused before it runs (its answer, bounded by
        max_tokens, is not known yet and is recorded whatever its size)."""
        if not (self.quota.max_record_bytes or self.quota.max_bytes):
            return
        growth = len(json.dumps(new_messages, separators=(",", ":")).encode())
        self.quota.check_record(len(lease.session.to_json().encode()) + growth, param="session_id")
        if self.quota.max_bytes:
            used = self.store.bytes_of(lease.session.tenant_id)
            self.quota.check(count=0, used_bytes=used, num_new_bytes=growth)

    def complete(self, turn: OpenTurn, *, prompt_token_ids: list[int], cached_tokens: int,
                 output_tokens: int) -> SessionRecord | None:
        """Append the turn; None if it was already closed. Store errors (409/404) propagate."""
        with turn.lock:
            if turn.closed:
                return None
            turn.closed = True
        answer = turn.capture.message() if turn.capture else {"role": "assistant", "content": ""}
        result = TurnResult(
            new_messages=[*turn.new_messages, answer], prefix_token_ids=list(prompt_token_ids),
            prompt_tokens=len(prompt_token_ids), cached_tokens=cached_tokens, output_tokens=output_tokens,
            kv_state=KVState.PINNED, replica_id=self.replica_id,
        )
        session_id = turn.lease.session.id
        with self._lock:
            self._pinned_here.add(session_id)
            self.stats.num_turns += 1
            self.stats.num_turn_prompt_tokens += len(prompt_token_ids)
            self.stats.num_turn_cached_tokens += cached_tokens
        return self.store.complete_turn(turn.lease, result)

    def abort(self, turn: OpenTurn) -> None:
        """End the turn without recording it (failed, refused, or the client left). Idempotent."""
        with turn.lock:
            if turn.closed:
                return
            turn.closed = True
        self.store.abort_turn(turn.lease)

    def delete(self, tenant_id: str, session_id: str) -> SessionRecord:
        record = self.store.delete(tenant_id, session_id)
        self._release_here(session_id)
        return record

    def delete_local(self, session_id: str) -> None:
        """Release the KV of a session the store no longer has (deleted or expired mid-turn)."""
        self._release_here(session_id)

    def sweep(self) -> list[str]:
        """Release the KV of sessions that expired or were deleted by another replica."""
        expired = self.store.pop_expired()
        with self._lock:
            candidates = list(self._pinned_here)
        alive = self.store.alive(candidates)
        gone = sorted(set(expired) | (set(candidates) - alive))
        for session_id in gone:
            self._release_here(session_id)
        return gone

    def release_all_here(self) -> int:
        """At shutdown: the KV this process pinned goes with it (or back to an engine that outlives it).

        The sessions themselves stay in the store; their next turn, here or on another replica,
        prefills what it needs again.
        """
        with self._lock:
            pinned = list(self._pinned_here)
        for session_id in pinned:
            self._release_here(session_id)
        return len(pinned)

    def _release_here(self, session_id: str) -> None:
        with self._lock:
            self._pinned_here.discard(session_id)
            self.stats.num_released += 1
        self._release(session_id)
