"""Where responses live between requests: the store, and the engine pins that keep a chain's KV.

Each stored response is generated under its own engine session key (its id),
so its KV (prompt and answer) stays pinned after it finishes; a response that
continues it (`previous_response_id`) renders the same tokens first and the
engine serves them from those blocks, prefilling only the new input. Once a
child is stored the parent's pin is let go: the child's pin holds every block
they share, so a later branch from the parent still finds them. Pinned KV is
offloaded to host memory or dropped under pressure exactly as sessions' is;
a continuation whose KV is gone re-prefills from the stored conversation.

A pin lives no longer than its response: it is released when the response
is deleted, when it expires or is deleted on another replica (`sweep`, every
`session_sweep_interval_s`), and at once when the response could not be
stored (the request failed, the client left, the tenant's store was full).
Each tenant's stored responses are capped in count and bytes (`quota`),
checked before any work (`check_room`) and again, atomically, when stored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

from loraplex.engine.core.client import EngineClient
from loraplex.platform.errors import NotFoundError
from loraplex.platform.extensions import Extensions
from loraplex.platform.pin_sweeper import sweep_while_running
from loraplex.platform.settings import Settings
from loraplex.sessions.quota import NO_QUOTA, StoreQuota
from loraplex.sessions.response_redis_store import RedisResponseStore
from loraplex.sessions.responses import (
    MemoryResponseStore,
    ResponseNotFoundError,
    ResponseStore,
    StoredResponse,
)

log = logging.getLogger(__name__)


class ResponseChains:
    def __init__(self, store: ResponseStore, *, engine: EngineClient, retention_s: int,
                 quota: StoreQuota = NO_QUOTA) -> None:
        self.store = store
        self.engine = engine
        self.retention_s = retention_s
        self.quota = quota
        self._pins: dict[str, tuple[str, float]] = {}  # pin key -> (response id, expires_at), pinned here
        self._lock = threading.Lock()

    @property
    def num_pinned_here(self) -> int:
        return len(self._pins)

    async def get(self, tenant_id: str, response_id: str, *, param: str | None = None) -> StoredResponse:
        try:
            return await asyncio.to_thread(self.store.get, tenant_id, response_id)
        except ResponseNotFoundError as exc:
            raise NotFoundError(exc.message, param=param, code="not_found") from None

    async def check_room(self, tenant_id: str, *, parts: list[Any]) -> None:
        """Refuse, before any work, a response that could not be stored: `parts` (what its record will hold
        for sure: the conversation it continues, its input) alone too large, or the tenant's store full."""
        num_bytes = await asyncio.to_thread(_json_bytes, parts)
        self.quota.check_record(num_bytes, param="store")
        if self.quota.max_count or self.quota.max_bytes:
            count, used = await asyncio.to_thread(self.store.usage, tenant_id)
            self.quota.check(count=count, used_bytes=used, num_new_bytes=num_bytes)

    async def save(self, record: StoredResponse, *, parent: StoredResponse | None) -> None:
        record.expires_at = record.created_at + self.retention_s
        await asyncio.to_thread(self.store.put, record, quota=self.quota)
        if record.pin_key:
            with self._lock:
                self._pins[record.pin_key] = (record.id, record.expires_at)
        if parent is not None and parent.pin_key and record.pin_key:
            self._release(parent.pin_key)

    def release_unstored(self, pin_key: str) -> None:
        """The response was not stored: nothing will continue from its KV."""
        self._release(pin_key)

    async def delete(self, tenant_id: str, response_id: str) -> None:
        try:
            record = await asyncio.to_thread(self.store.delete, tenant_id, response_id)
        except ResponseNotFoundError as exc:
            raise NotFoundError(exc.message, code="not_found") from None
        if record.pin_key:
            self._release(record.pin_key)

    def sweep(self, *, now: float | None = None) -> list[str]:
        """Release the pins of responses that expired, or that another replica deleted; their pin keys."""
        now = time.time() if now is None else now
        with self._lock:
            held = dict(self._pins)
        expired = {key for key, (_, expires_at) in held.items() if expires_at <= now}
        rest = {key: response_id for key, (response_id, _) in held.items() if key not in expired}
        alive = self.store.alive(list(rest.values())) if rest else set()
        gone = sorted(expired | {key for key, response_id in rest.items() if response_id not in alive})
        for key in gone:
            self._release(key)
        return gone

    def release_all_here(self) -> int:
        with self._lock:
            keys = list(self._pins)
        for key in keys:
            self._release(key)
        return len(keys)

    def _release(self, pin_key: str) -> None:
        with self._lock:
            self._pins.pop(pin_key, None)
        self.engine.release_session(pin_key)


def _json_bytes(parts: list[Any]) -> int:
    return len(json.dumps(parts, separators=(",", ":"), ensure_ascii=False).encode())


def make_response_store(settings: Settings) -> ResponseStore:
    if not settings.redis_url:
        return MemoryResponseStore()
    import redis

    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
    return RedisResponseStore(client, key_prefix=settings.redis_key_prefix)


def response_quota(settings: Settings) -> StoreQuota:
    return StoreQuota(
        what="stored responses", max_count=settings.max_stored_responses_per_tenant,
        max_bytes=settings.max_stored_response_bytes_per_tenant, max_record_bytes=settings.max_stored_response_bytes,
        max_count_setting="max_stored_responses_per_tenant",
        max_bytes_setting="max_stored_response_bytes_per_tenant", max_record_bytes_setting="max_stored_response_bytes",
    )


def install_responses(extensions: Extensions, settings: Settings, *, engine: EngineClient) -> ResponseChains:
    chains = ResponseChains(make_response_store(settings), engine=engine, retention_s=settings.response_retention_s,
                            quota=response_quota(settings))
    extensions.domain_state["responses"] = chains
    sweep_while_running(extensions, chains, settings.session_sweep_interval_s, "response pin")
    return chains
