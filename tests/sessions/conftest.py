"""Session-store fixtures: every store test runs against real Redis and the in-process store."""

from __future__ import annotations

import pytest
from loraplex.sessions.memory_store import MemorySessionStore
from loraplex.sessions.redis_store import RedisSessionStore


@pytest.fixture(params=["redis", "memory"])
def store(request):
    if request.param == "memory":
        return MemorySessionStore()
    client = request.getfixturevalue("redis_client")
    return RedisSessionStore(client, key_prefix=request.getfixturevalue("key_prefix"))
