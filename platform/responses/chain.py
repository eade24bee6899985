"""Where responses live between requests: the store, and the engine pins that keep a chain's KV.

Each stored response is generated under its own engine session key (its id),
so its KV (prompt and answer) stays pinned after it finishes; a response that
continues it (`previous_response_id`) renders the same tokens first and the
engine serves them from those blocks, prefilling only the new input. Once a
child is stored the parent's pin is let go: the child's pin holds every block
they share, so a later branch from the parent still finds them. Pinned KV is
offloaded to host memory or dropped under pressure exactly as sessions' is;
a continuation whose KV is gone re-prefills from the stored conversation.
"""

from __future__ import annotations

import asyncio

from loraplex.engine.core.client import EngineClient
from loraplex.platform.errors import NotFoundError
from loraplex.platform.extensions import Extensions
from loraplex.platform.settings import Settings
from loraplex.sessions.response_redis_store import RedisResponseStore
from loraplex.sessions.responses import (
    MemoryResponseStore,
    ResponseNotFoundError,
    ResponseStore,
    StoredResponse,
)


class ResponseChains:
    def __init__(self, store: ResponseStore, *, engine: EngineClient, retention_s: int) -> None:
        self.store = store
        self.engine = engine
        self.retention_s = retention_s

    async def get(self, tenant_id: str, response_id: str, *, param: str | None = None) -> StoredResponse:
        try:
            return await asyncio.to_thread(self.store.get, tenant_id, response_id)
        except ResponseNotFoundError as exc:
            raise NotFoundError(exc.message, param=param, code="not_found") from None

    async def save(self, record: StoredResponse, *, parent: StoredResponse | None) -> None:
        record.expires_at = record.created_at + self.retention_s
        await asyncio.to_thread(self.store.put, record)
        if parent is not None and parent.pin_key and record.pin_key:
            self.engine.release_session(parent.pin_key)

    async def delete(self, tenant_id: str, response_id: str) -> None:
        try:
            record = await asyncio.to_thread(self.store.delete, tenant_id, response_id)
        except ResponseNotFoundError as exc:
            raise NotFoundError(exc.message, code="not_found") from None
        if record.pin_key:
            self.engine.release_session(record.pin_key)


def make_response_store(settings: Settings) -> ResponseStore:
    if not settings.redis_url:
        return MemoryResponseStore()
    import redis

    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
    return RedisResponseStore(client, key_prefix=settings.redis_key_prefix)


def install_responses(extensions: Extensions, settings: Settings, *, engine: EngineClient) -> ResponseChains:
    chains = ResponseChains(make_response_store(settings), engine=engine, retention_s=settings.response_retention_s)
    extensions.domain_state["responses"] = chains
    return chains
