"""The Redis session store, shared by every replica.

Layout under the key prefix:
  session:<id>          hash {tenant_id, version, data (record JSON), kv_state, ttl_seconds}; Redis TTL = the session's
  session:<id>:lease    the running turn's token (SET NX PX): one turn at a time
  sessions:tenant:<t>   sorted set of the tenant's ids by creation time, for listing
  sessions:expiry       sorted set of ids by expiry time, for releasing KV of expired sessions
  sessions:owner        hash id -> tenant, to clean the tenant index after expiry
  sessions:sizes        hash id -> bytes of its record; sessions:bytes  hash tenant -> the sum of its sessions'
Every check-then-write is one Lua script, so it is atomic across replicas. A client-given id that is not
one this store could have made (a ':' would reach another key, `session:<id>:lease` a string) is unknown.
"""

from __future__ import annotations

import builtins
import secrets
import time
from typing import Any

from loraplex.sessions.errors import (
    SessionBusyError,
    SessionConflictError,
    SessionLimitError,
    SessionNotFoundError,
)
from loraplex.sessions.quota import NO_QUOTA, OVER_BYTES, StoreQuota
from loraplex.sessions.store import (
    KVState,
    SessionPage,
    SessionRecord,
    TurnLease,
    TurnResult,
    apply_turn,
    is_session_id,
)

# Count the tenant's live sessions (dropping expired ids from its index) and their bytes, and create only
# under both caps: 1 created, 0 past the count, 2 past the bytes.
_CREATE = """
local max = tonumber(ARGV[9])
if max > 0 then
  local live = 0
  for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    if redis.call('EXISTS', ARGV[10] .. id) == 1 then live = live + 1 else redis.call('ZREM', KEYS[2], id) end
  end
  if live >= max then return 0 end
end
local max_bytes = tonumber(ARGV[12])
if max_bytes > 0 and tonumber(redis.call('HGET', KEYS[6], ARGV[1]) or '0') + tonumber(ARGV[11]) > max_bytes then
  return 2
end
redis.call('HSET', KEYS[1], 'tenant_id', ARGV[1], 'version', ARGV[2], 'data', ARGV[3], 'kv_state', ARGV[4],
           'ttl_seconds', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('ZADD', KEYS[2], ARGV[6], ARGV[8])
redis.call('ZADD', KEYS[3], ARGV[7], ARGV[8])
redis.call('HSET', KEYS[4], ARGV[8], ARGV[1])
redis.call('HSET', KEYS[5], ARGV[8], ARGV[11])
redis.call('HINCRBY', KEYS[6], ARGV[1], ARGV[11])
return 1
"""

_BEGIN = """
local tenant = redis.call('HGET', KEYS[1], 'tenant_id')
if not tenant or tenant ~= ARGV[1] then return {0} end
if not redis.call('SET', KEYS[2], ARGV[2], 'NX', 'PX', ARGV[3]) then return {2} end
-- A session never expires under a running turn: hold it for TTL + lease; the turn's end resets the TTL.
local hold = tonumber(redis.call('HGET', KEYS[1], 'ttl_seconds')) + math.ceil(tonumber(ARGV[3]) / 1000)
redis.call('EXPIRE', KEYS[1], hold)
redis.call('ZADD', KEYS[3], tonumber(ARGV[4]) + hold, ARGV[5])
return {1, redis.call('HGET', KEYS[1], 'data'), redis.call('HGET', KEYS[1], 'kv_state')}
"""

# A lease that ran out still completes its turn unless another turn took the session since.
_COMPLETE = """
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] then return -1 end
local version = redis.call('HGET', KEYS[1], 'version')
if not version then return -2 end
if version ~= ARGV[2] then return -1 end
redis.call('HSET', KEYS[1], 'data', ARGV[3], 'version', ARGV[4], 'kv_state', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('ZADD', KEYS[3], ARGV[7], ARGV[8])
redis.call('DEL', KEYS[2])
local old = tonumber(redis.call('HGET', KEYS[4], ARGV[8]) or '0')
redis.call('HSET', KEYS[4], ARGV[8], ARGV[9])
redis.call('HINCRBY', KEYS[5], ARGV[10], tonumber(ARGV[9]) - old)
return 1
"""

_ABORT = """
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
if redis.call('EXPIRE', KEYS[1], ARGV[2]) == 1 then redis.call('ZADD', KEYS[3], ARGV[3], ARGV[4]) end
return 1
"""

_DELETE = """
local tenant = redis.call('HGET', KEYS[1], 'tenant_id')
if not tenant or tenant ~= ARGV[1] then return false end
local data = redis.call('HGET', KEYS[1], 'data')
local kv_state = redis.call('HGET', KEYS[1], 'kv_state')
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[2])
redis.call('HDEL', KEYS[5], ARGV[2])
local size = redis.call('HGET', KEYS[6], ARGV[2])
if size then
  redis.call('HINCRBY', KEYS[7], ARGV[1], -tonumber(size))
  redis.call('HDEL', KEYS[6], ARGV[2])
end
return {data, kv_state}
"""

# An expired session's bytes leave its tenant's total (run by whichever sweeper retired the id).
_FORGET_SIZE = """
local size = redis.call('HGET', KEYS[1], ARGV[2])
if size then
  redis.call('HINCRBY', KEYS[2], ARGV[1], -tonumber(size))
  redis.call('HDEL', KEYS[1], ARGV[2])
end
return 1
"""

_SET_KV_STATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'kv_state', ARGV[1]) end
return 1
"""


class RedisSessionStore:
    def __init__(self, client: Any, *, key_prefix: str = "lpx:") -> None:
        self._redis = client
        self._prefix = key_prefix
        self._create = client.register_script(_CREATE)
        self._begin = client.register_script(_BEGIN)
        self._complete = client.register_script(_COMPLETE)
        self._abort = client.register_script(_ABORT)
        self._delete = client.register_script(_DELETE)
        self._set_kv_state = client.register_script(_SET_KV_STATE)
        self._forget_size = client.register_script(_FORGET_SIZE)

    def create(self, record: SessionRecord, *, max_per_tenant: int = 0, quota: StoreQuota = NO_QUOTA) -> SessionRecord:
        record.expires_at = time.time() + record.ttl_seconds
        data = record.to_json()
        num_bytes = len(data.encode())
        quota.check_record(num_bytes)
        keys = [self._key(record.id), self._tenant_key(record.tenant_id), self._expiry_key, self._owner_key,
                self._sizes_key, self._bytes_key]
        args = [record.tenant_id, record.version, data, record.kv_state, record.ttl_seconds,
                record.created_at, record.expires_at, record.id, max_per_tenant, self._key(""), num_bytes,
                quota.max_bytes]
        created = self._create(keys=keys, args=args)
        if created == 0:
            raise SessionLimitError(max_per_tenant)
        if created == 2:
            quota.raise_for(OVER_BYTES, count=0, used_bytes=self.bytes_of(record.tenant_id))
        return record

    def bytes_of(self, tenant_id: str) -> int:
        return int(self._redis.hget(self._bytes_key, tenant_id) or 0)

    def get(self, tenant_id: str, session_id: str) -> SessionRecord:
        _check_id(session_id)
        tenant, data, kv_state = self._redis.hmget(self._key(session_id), "tenant_id", "data", "kv_state")
        if tenant is None or _text(tenant) != tenant_id:
            raise SessionNotFoundError(session_id)
        return self._record(data, kv_state, self._redis.pttl(self._key(session_id)))

    def list(self, tenant_id: str, *, limit: int = 20, after: str | None = None) -> SessionPage:
        index = self._tenant_key(tenant_id)
        start = 0
        if after is not None:
            rank = self._redis.zrevrank(index, after)
            if rank is None:
                return SessionPage(data=[], has_more=False)
            start = rank + 1
        found: list[SessionRecord] = []
        while True:
            ids = [_text(i) for i in self._redis.zrevrange(index, start, start + limit)]  # one extra: has_more
            if not ids:
                return SessionPage(data=found, has_more=False)
            pipe = self._redis.pipeline(transaction=False)
            for session_id in ids:
                pipe.hmget(self._key(session_id), "data", "kv_state")
            gone = []
            for session_id, (data, kv_state) in zip(ids, pipe.execute(), strict=True):
                if data is None:
                    gone.append(session_id)  # expired: drop it from the index lazily
                elif len(found) == limit:
                    return SessionPage(data=found, has_more=True)
                else:
                    found.append(self._record(data, kv_state))
            if gone:
                self._redis.zrem(index, *gone)
            start += len(ids) - len(gone)

    def delete(self, tenant_id: str, session_id: str) -> SessionRecord:
        _check_id(session_id)
        keys = [self._key(session_id), self._lease_key(session_id), self._tenant_key(tenant_id),
                self._expiry_key, self._owner_key, self._sizes_key, self._bytes_key]
        removed = self._delete(keys=keys, args=[tenant_id, session_id])
        if not removed:
            raise SessionNotFoundError(session_id)
        return self._record(removed[0], removed[1])

    def begin_turn(self, tenant_id: str, session_id: str, *, lease_s: float = 600.0) -> TurnLease:
        _check_id(session_id)
        lease_token = secrets.token_hex(16)
        now = time.time()
        reply = self._begin(
            keys=[self._key(session_id), self._lease_key(session_id), self._expiry_key],
            args=[tenant_id, lease_token, int(lease_s * 1000), now, session_id],
        )
        if reply[0] == 0:
            raise SessionNotFoundError(session_id)
        if reply[0] == 2:
            raise SessionBusyError(session_id)
        record = self._record(reply[1], reply[2])
        record.expires_at = now + record.ttl_seconds
        return TurnLease(session=record, token=lease_token)

    def complete_turn(self, lease: TurnLease, result: TurnResult) -> SessionRecord:
        session = lease.session
        updated = apply_turn(session, result, now=time.time())
        data = updated.to_json()
        outcome = self._complete(
            keys=[self._key(session.id), self._lease_key(session.id), self._expiry_key, self._sizes_key,
                  self._bytes_key],
            args=[lease.token, session.version, data, updated.version, updated.kv_state,
                  updated.ttl_seconds, updated.expires_at, session.id, len(data.encode()), session.tenant_id],
        )
        if outcome == -2:
            raise SessionNotFoundError(session.id)
        if outcome == -1:
            raise SessionConflictError(session.id)
        return updated

    def abort_turn(self, lease: TurnLease) -> None:
        session = lease.session
        self._abort(
            keys=[self._key(session.id), self._lease_key(session.id), self._expiry_key],
            args=[lease.token, session.ttl_seconds, time.time() + session.ttl_seconds, session.id],
        )

    def set_kv_state(self, session_id: str, kv_state: str) -> None:
        if kv_state not in KVState.ALL:
            raise ValueError(f"unknown KV state {kv_state!r}")
        self._set_kv_state(keys=[self._key(session_id)], args=[kv_state])

    def pop_expired(self, *, now: float | None = None) -> builtins.list[str]:
        now = time.time() if now is None else now
        candidates = [_text(i) for i in self._redis.zrangebyscore(self._expiry_key, "-inf", now)]
        expired = []
        for session_id in candidates:
            if self._redis.exists(self._key(session_id)):
                continue  # Redis has not expired it yet (clocks); next sweep
            if self._redis.zrem(self._expiry_key, session_id):  # 0 if another sweeper took it first
                tenant = self._redis.hget(self._owner_key, session_id)
                if tenant is not None:
                    self._redis.zrem(self._tenant_key(_text(tenant)), session_id)
                    self._redis.hdel(self._owner_key, session_id)
                    self._forget_size(keys=[self._sizes_key, self._bytes_key], args=[_text(tenant), session_id])
                expired.append(session_id)
        return expired

    def alive(self, session_ids: builtins.list[str]) -> set[str]:
        if not session_ids:
            return set()
        pipe = self._redis.pipeline(transaction=False)
        for session_id in session_ids:
            pipe.exists(self._key(session_id))
        return {sid for sid, exists in zip(session_ids, pipe.execute(), strict=True) if exists}

    def _record(self, data: bytes | str, kv_state: bytes | str | None, ttl_ms: int | None = None) -> SessionRecord:
        record = SessionRecord.from_json(data)
        if kv_state is not None:
            record.kv_state = _text(kv_state)
        if ttl_ms is not None and ttl_ms >= 0:
            record.expires_at = time.time() + ttl_ms / 1000  # Redis's TTL is the truth for expiry
        return record

    def _key(self, session_id: str) -> str:
        return f"{self._prefix}session:{session_id}"

    def _lease_key(self, session_id: str) -> str:
        return f"{self._prefix}session:{session_id}:lease"

    def _tenant_key(self, tenant_id: str) -> str:
        return f"{self._prefix}sessions:tenant:{tenant_id}"

    @property
    def _expiry_key(self) -> str:
        return f"{self._prefix}sessions:expiry"

    @property
    def _owner_key(self) -> str:
        return f"{self._prefix}sessions:owner"

    @property
    def _sizes_key(self) -> str:
        return f"{self._prefix}sessions:sizes"

    @property
    def _bytes_key(self) -> str:
        return f"{self._prefix}sessions:bytes"


def _check_id(session_id: str) -> None:
    if not is_session_id(session_id):
        raise SessionNotFoundError(session_id[:80])


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
