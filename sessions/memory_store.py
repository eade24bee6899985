"""The in-process session store: one process, no Redis; same semantics as the Redis store."""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Callable

from loraplex.sessions.errors import (
    SessionBusyError,
    SessionConflictError,
    SessionLimitError,
    SessionNotFoundError,
)
from loraplex.sessions.quota import NO_QUOTA, StoreQuota
from loraplex.sessions.store import KVState, SessionPage, SessionRecord, TurnLease, TurnResult, apply_turn


class MemorySessionStore:
    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._records: dict[str, SessionRecord] = {}
        self._leases: dict[str, tuple[str, float]] = {}   # session id -> (token, lease expiry)
        self._expired: list[str] = []
        self._sizes: dict[str, int] = {}   # session id -> bytes of its record
        self._bytes: dict[str, int] = {}   # tenant -> the sum of its sessions'
        self._lock = threading.Lock()

    def create(self, record: SessionRecord, *, max_per_tenant: int = 0, quota: StoreQuota = NO_QUOTA) -> SessionRecord:
        """`max_per_tenant`: refuse (SessionLimitError) when the tenant already has that many live; 0: no cap.
        `quota`: its bytes caps (the record's own, the tenant's sum)."""
        with self._lock:
            record.expires_at = self._clock() + record.ttl_seconds
            num_bytes = len(record.to_json().encode())
            quota.check_record(num_bytes)
            self._expire()
            if max_per_tenant and sum(r.tenant_id == record.tenant_id for r in self._records.values()) >= max_per_tenant:
                raise SessionLimitError(max_per_tenant)
            used = self._bytes.get(record.tenant_id, 0)
            quota.check(count=0, used_bytes=used, num_new_bytes=num_bytes)  # the count: max_per_tenant
            self._records[record.id] = _copy(record)
            self._set_size(record, num_bytes)
        return record

    def bytes_of(self, tenant_id: str) -> int:
        with self._lock:
            self._expire()
            return self._bytes.get(tenant_id, 0)

    def get(self, tenant_id: str, session_id: str) -> SessionRecord:
        with self._lock:
            return _copy(self._live(tenant_id, session_id))

    def list(self, tenant_id: str, *, limit: int = 20, after: str | None = None) -> SessionPage:
        with self._lock:
            self._expire()
            mine = sorted(
                (r for r in self._records.values() if r.tenant_id == tenant_id),
                key=lambda r: (r.created_at, r.id),
                reverse=True,
            )
        if after is not None:
            ids = [r.id for r in mine]
            mine = mine[ids.index(after) + 1:] if after in ids else []
        return SessionPage(data=[_copy(r) for r in mine[:limit]], has_more=len(mine) > limit)

    def delete(self, tenant_id: str, session_id: str) -> SessionRecord:
        with self._lock:
            record = self._live(tenant_id, session_id)
            self._forget(session_id)
            return record

    def begin_turn(self, tenant_id: str, session_id: str, *, lease_s: float = 600.0) -> TurnLease:
        with self._lock:
            record = self._live(tenant_id, session_id)
            held = self._leases.get(session_id)
            now = self._clock()
            if held is not None and held[1] > now:
                raise SessionBusyError(session_id)
            lease = TurnLease(session=_copy(record))
            lease.session.expires_at = now + record.ttl_seconds
            # A session never expires under a running turn: hold it for TTL + lease; the turn's end resets it.
            record.expires_at = now + record.ttl_seconds + lease_s
            self._leases[session_id] = (lease.token, now + lease_s)
            return lease

    def complete_turn(self, lease: TurnLease, result: TurnResult) -> SessionRecord:
        session_id = lease.session.id
        with self._lock:
            record = self._live(lease.session.tenant_id, session_id)
            if self._held_by_another(lease) or record.version != lease.session.version:
                raise SessionConflictError(session_id)
            updated = apply_turn(record, result, now=self._clock())
            self._records[session_id] = updated
            self._set_size(updated, len(updated.to_json().encode()))
            self._leases.pop(session_id, None)
            return _copy(updated)

    def abort_turn(self, lease: TurnLease) -> None:
        with self._lock:
            if not self._held_by_another(lease):
                self._leases.pop(lease.session.id, None)
            record = self._records.get(lease.session.id)
            if record is not None:
                record.expires_at = self._clock() + record.ttl_seconds

    def set_kv_state(self, session_id: str, kv_state: str) -> None:
        if kv_state not in KVState.ALL:
            raise ValueError(f"unknown KV state {kv_state!r}")
        with self._lock:
            record = self._records.get(session_id)
            if record is not None:
                record.kv_state = kv_state

    def pop_expired(self, *, now: float | None = None) -> builtins.list[str]:
        with self._lock:
            self._expire(now)
            expired, self._expired = self._expired, []
            return expired

    def alive(self, session_ids: builtins.list[str]) -> set[str]:
        with self._lock:
            self._expire()
            return {session_id for session_id in session_ids if session_id in self._records}

    def _held_by_another(self, lease: TurnLease) -> bool:
        """A lease that ran out is still good unless another turn has taken the session since."""
        held = self._leases.get(lease.session.id)
        return held is not None and held[0] != lease.token and held[1] > self._clock()

    def _live(self, tenant_id: str, session_id: str) -> SessionRecord:
        self._expire()
        record = self._records.get(session_id)
        if record is None or record.tenant_id != tenant_id:
            raise SessionNotFoundError(session_id)
        return record

    def _expire(self, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        for session_id in [sid for sid, r in self._records.items() if r.expires_at <= now]:
            self._forget(session_id)
            self._expired.append(session_id)

    def _forget(self, session_id: str) -> None:
        record = self._records.pop(session_id)
        self._leases.pop(session_id, None)
        self._set_size(record, 0)
        self._sizes.pop(session_id, None)

    def _set_size(self, record: SessionRecord, num_bytes: int) -> None:
        delta = num_bytes - self._sizes.get(record.id, 0)
        self._sizes[record.id] = num_bytes
        total = self._bytes.get(record.tenant_id, 0) + delta
        if total:
            self._bytes[record.tenant_id] = total
        else:
            self._bytes.pop(record.tenant_id, None)


def _copy(record: SessionRecord) -> SessionRecord:
    return SessionRecord.from_json(record.to_json())
