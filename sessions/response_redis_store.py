"""The Redis response store, shared by every replica: one hash per response, expiring with it.

Layout under the key prefix:
  response:<id>   hash {tenant_id, data (record JSON)}; Redis TTL = the retention period left
The tenant check and the read (or delete) are one Lua script, so a response
is never returned to, or removed by, another tenant.
"""

from __future__ import annotations

import math
import time
from typing import Any

from loraplex.sessions.responses import ResponseNotFoundError, StoredResponse

_GET = """
local tenant = redis.call('HGET', KEYS[1], 'tenant_id')
if not tenant or tenant ~= ARGV[1] then return false end
return redis.call('HGET', KEYS[1], 'data')
"""

_DELETE = """
local tenant = redis.call('HGET', KEYS[1], 'tenant_id')
if not tenant or tenant ~= ARGV[1] then return false end
local data = redis.call('HGET', KEYS[1], 'data')
redis.call('DEL', KEYS[1])
return data
"""


class RedisResponseStore:
    def __init__(self, client: Any, *, key_prefix: str = "loraplex:") -> None:
        self.client = client
        self.prefix = key_prefix
        self._get = client.register_script(_GET)
        self._delete = client.register_script(_DELETE)

    def _key(self, response_id: str) -> str:
        return f"{self.prefix}response:{response_id}"

    def put(self, record: StoredResponse) -> None:
        ttl = math.ceil(record.expires_at - time.time())
        if ttl <= 0:
            return
        key = self._key(record.id)
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(key, mapping={"tenant_id": record.tenant_id, "data": record.to_json()})
        pipe.expire(key, ttl)
        pipe.execute()

    def get(self, tenant_id: str, response_id: str) -> StoredResponse:
        data = self._get(keys=[self._key(response_id)], args=[tenant_id])
        if data is None:
            raise ResponseNotFoundError(f"No response found with id '{response_id}'")
        return StoredResponse.from_json(data)

    def delete(self, tenant_id: str, response_id: str) -> StoredResponse:
        data = self._delete(keys=[self._key(response_id)], args=[tenant_id])
        if data is None:
            raise ResponseNotFoundError(f"No response found with id '{response_id}'")
        return StoredResponse.from_json(data)
