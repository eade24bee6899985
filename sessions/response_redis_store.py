"""The Redis response store, shared by every replica: one hash per response, expiring with it.

Layout under the key prefix:
  response:<id>              hash {tenant_id, data (record JSON)}; expiring at the record's expires_at
  responses:tenant:<t>       sorted set of the tenant's ids by expiry time
  responses:sizes:<t>        hash id -> bytes of each of the tenant's records
  responses:bytes:<t>        the sum of those sizes
The tenant check and the read (or delete) are one Lua script, so a response
is never returned to, or removed by, another tenant. Storing counts the
tenant's records and bytes and writes in one script, so concurrent saves on
any replica never pass the tenant's caps; each script first retires the
tenant's expired ids (each one once), so no call walks every record.
"""

from __future__ import annotations

import math
import time
from typing import Any

from loraplex.sessions.quota import NO_QUOTA, StoreQuota
from loraplex.sessions.responses import ResponseNotFoundError, StoredResponse

# KEYS[2..4]: index, sizes, total. The shared head of the scripts that count.
_RETIRE_EXPIRED = """
local function retire(now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
    local size = redis.call('HGET', KEYS[3], id)
    if size then
      redis.call('DECRBY', KEYS[4], size)
      redis.call('HDEL', KEYS[3], id)
    end
    redis.call('ZREM', KEYS[2], id)
  end
end
"""

# KEYS: record, index, sizes, total. ARGV: tenant, data, expires_at (ms), expires_at, now, id, size, max_count,
# max_bytes, index ttl. Returns {0} stored, {1, count} past the count cap, {2, bytes} past the bytes cap.
_PUT = _RETIRE_EXPIRED + """
retire(ARGV[5])
local size = tonumber(ARGV[7])
local count = redis.call('ZCARD', KEYS[2])
local used = tonumber(redis.call('GET', KEYS[4]) or '0')
local old = redis.call('HGET', KEYS[3], ARGV[6])
if old then
  count = count - 1
  used = used - tonumber(old)
end
local max_count, max_bytes = tonumber(ARGV[8]), tonumber(ARGV[9])
if max_count > 0 and count + 1 > max_count then return {1, count} end
if max_bytes > 0 and used + size > max_bytes then return {2, used} end
if old then redis.call('DECRBY', KEYS[4], old) end
redis.call('HSET', KEYS[1], 'tenant_id', ARGV[1], 'data', ARGV[2])
redis.call('PEXPIREAT', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[6])
redis.call('HSET', KEYS[3], ARGV[6], size)
redis.call('INCRBY', KEYS[4], size)
for i = 2, 4 do redis.call('EXPIRE', KEYS[i], ARGV[10]) end
return {0}
"""

# KEYS: record, index, sizes, total. ARGV: now.
_USAGE = _RETIRE_EXPIRED + """
retire(ARGV[1])
return {redis.call('ZCARD', KEYS[2]), tonumber(redis.call('GET', KEYS[4]) or '0')}
"""

_GET = """
local tenant = redis.call('HGET', KEYS[1], 'tenant_id')
if not tenant or tenant ~= ARGV[1] then return false end
return redis.call('HGET', KEYS[1], 'data')
"""

# KEYS: record, index, sizes, total. ARGV: tenant, id.
_DELETE = """
local tenant = redis.call('HGET', KEYS[1], 'tenant_id')
if not tenant or tenant ~= ARGV[1] then return false end
local data = redis.call('HGET', KEYS[1], 'data')
redis.call('DEL', KEYS[1])
local size = redis.call('HGET', KEYS[3], ARGV[2])
if size then
  redis.call('DECRBY', KEYS[4], size)
  redis.call('HDEL', KEYS[3], ARGV[2])
end
redis.call('ZREM', KEYS[2], ARGV[2])
return data
"""

_INDEX_SLACK_S = 60  # a tenant's index outlives its newest record by this much


class RedisResponseStore:
    def __init__(self, client: Any, *, key_prefix: str = "loraplex:") -> None:
        self.client = client
        self.prefix = key_prefix
        self._put = client.register_script(_PUT)
        self._usage = client.register_script(_USAGE)
        self._get = client.register_script(_GET)
        self._delete = client.register_script(_DELETE)

    def _key(self, response_id: str) -> str:
        return f"{self.prefix}response:{response_id}"

    def _keys(self, tenant_id: str, response_id: str) -> list[str]:
        return [self._key(response_id), f"{self.prefix}responses:tenant:{tenant_id}",
                f"{self.prefix}responses:sizes:{tenant_id}", f"{self.prefix}responses:bytes:{tenant_id}"]

    def put(self, record: StoredResponse, *, quota: StoreQuota = NO_QUOTA) -> None:
        data = record.to_json()
        num_bytes = len(data.encode())
        quota.check_record(num_bytes)
        now = time.time()
        ttl = math.ceil(record.expires_at - now)
        if ttl <= 0:
            return
        reply = self._put(keys=self._keys(record.tenant_id, record.id),
                          args=[record.tenant_id, data, math.ceil(record.expires_at * 1000), record.expires_at, now,
                                record.id, num_bytes,
                                quota.max_count, quota.max_bytes, ttl + _INDEX_SLACK_S])
        if int(reply[0]):
            count, used = (int(reply[1]), 0) if int(reply[0]) == 1 else (0, int(reply[1]))
            quota.raise_for(int(reply[0]), count=count, used_bytes=used)

    def usage(self, tenant_id: str) -> tuple[int, int]:
        count, used = self._usage(keys=self._keys(tenant_id, ""), args=[time.time()])
        return int(count), int(used)

    def get(self, tenant_id: str, response_id: str) -> StoredResponse:
        data = self._get(keys=[self._key(response_id)], args=[tenant_id]) if _is_id(response_id) else None
        if data is None:
            raise ResponseNotFoundError(f"No response found with id '{response_id[:80]}'")
        return StoredResponse.from_json(data)

    def delete(self, tenant_id: str, response_id: str) -> StoredResponse:
        data = (self._delete(keys=self._keys(tenant_id, response_id), args=[tenant_id, response_id])
                if _is_id(response_id) else None)
        if data is None:
            raise ResponseNotFoundError(f"No response found with id '{response_id[:80]}'")
        return StoredResponse.from_json(data)

    def alive(self, response_ids: list[str]) -> set[str]:
        if not response_ids:
            return set()
        pipe = self.client.pipeline(transaction=False)
        for response_id in response_ids:
            pipe.exists(self._key(response_id))
        return {rid for rid, exists in zip(response_ids, pipe.execute(), strict=True) if exists}


def _is_id(response_id: str) -> bool:
    """Ids are ours (`resp_` and hex): one with ':' would name another key."""
    return 0 < len(response_id) <= 128 and ":" not in response_id
