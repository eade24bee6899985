"""Session-store fixtures: every store test runs against real Redis and the in-process store."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from loraplex.sessions.memory_store import MemorySessionStore
from loraplex.sessions.redis_store import RedisSessionStore

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    yield client
    client.close()


@pytest.fixture
def key_prefix(redis_client: redis.Redis) -> Iterator[str]:
    prefix = f"lpxtest:sessions:{uuid.uuid4().hex[:8]}:"
    yield prefix
    keys = list(redis_client.scan_iter(match=f"{prefix}*"))
    if keys:
        redis_client.delete(*keys)


@pytest.fixture(params=["redis", "memory"])
def store(request):
    if request.param == "memory":
        return MemorySessionStore()
    client = request.getfixturevalue("redis_client")
    return RedisSessionStore(client, key_prefix=request.getfixturevalue("key_prefix"))
