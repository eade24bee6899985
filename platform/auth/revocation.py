"""Key revocations reach every process at once through Redis: a set that remembers them, a channel that
announces them.

`announce_revocation` (the API's revoke route through `KeyCache.forget_key`,
and the CLI) adds the key id to the set and publishes it. Each API process
runs one `RedisRevocationFeed`: a daemon thread subscribed to the channel
that drops announced keys from the process's `KeyCache`. Whenever the
subscription (re)connects it re-reads the whole set first, so an
announcement missed while disconnected is not lost; while disconnected the
feed reports itself unhealthy and the cache falls back to its time-based
rules (platform/auth/key_cache.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from loraplex.platform.auth.key_cache import KeyCache
from loraplex.platform.settings import Settings

log = logging.getLogger(__name__)


def revocation_keys(prefix: str) -> tuple[str, str]:
    """(the set of revoked key ids, the channel announcing new ones)."""
    return f"{prefix}auth:revoked", f"{prefix}auth:revocations"


def announce_revocation(client: Any, prefix: str, key_id: str) -> None:
    revoked_set, channel = revocation_keys(prefix)
    pipe = client.pipeline(transaction=True)
    pipe.sadd(revoked_set, key_id)
    pipe.publish(channel, key_id)
    pipe.execute()


class RedisRevocationFeed:
    def __init__(self, redis_url: str, prefix: str, cache: KeyCache[Any], *, retry_s: float = 1.0) -> None:
        import redis

        self._redis = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
        self._listen_client = redis.Redis.from_url(redis_url, socket_connect_timeout=5)
        self._prefix = prefix
        self._cache = cache
        self._retry_s = retry_s
        self._healthy = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="key-revocation-feed", daemon=True)

    @property
    def healthy(self) -> bool:
        return self._healthy.is_set()

    def start(self, *, wait_s: float = 5.0) -> None:
        """Start listening; wait (a little) for the first sync, so a new process starts knowing every revocation."""
        self._cache.feed = self
        self._thread.start()
        if not self._healthy.wait(wait_s):
            log.warning("the key revocation feed is not connected yet; revocations by other processes apply "
                        "within the key cache's fresh time until it is")

    def announce(self, key_id: str) -> None:
        try:
            announce_revocation(self._redis, self._prefix, key_id)
        except Exception:  # the database revocation stands; other processes see it within the fresh time
            log.exception("could not announce the revocation of %s through Redis", key_id)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        self._redis.close()
        self._listen_client.close()

    def _run(self) -> None:
        revoked_set, channel = revocation_keys(self._prefix)
        while not self._stopped.is_set():
            pubsub = self._listen_client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(channel)
                for key_id in self._listen_client.smembers(revoked_set):  # after subscribing: nothing falls between
                    self._cache.mark_revoked(key_id.decode() if isinstance(key_id, bytes) else key_id)
                self._healthy.set()
                while not self._stopped.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is not None and message["type"] == "message":
                        self._cache.mark_revoked(message["data"].decode())
            except Exception as exc:
                if self._healthy.is_set():
                    log.warning("key revocation feed disconnected (%s); reconnecting", type(exc).__name__)
                self._healthy.clear()
                self._stopped.wait(self._retry_s)
            finally:
                self._healthy.clear()
                pubsub.close()


def build_key_cache(settings: Settings, on_shutdown: list[Callable[[], Awaitable[None]]]) -> KeyCache[Any]:
    """The process's key cache; with Redis, fed by the revocation feed (stopped by `on_shutdown`)."""
    cache: KeyCache[Any] = KeyCache(fresh_s=settings.key_cache_fresh_s, stale_s=settings.key_cache_stale_s)
    if settings.redis_url and settings.key_cache_fresh_s > 0:
        feed = RedisRevocationFeed(settings.redis_url, settings.redis_key_prefix, cache)
        feed.start()

        async def stop_feed() -> None:
            await asyncio.to_thread(feed.stop)

        on_shutdown.append(stop_feed)
    return cache


def announce_if_configured(settings: Settings, key_id: str) -> None:
    """For revocations made outside an API process (the CLI): tell the running servers at once."""
    if not settings.redis_url:
        return
    import redis

    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
    try:
        announce_revocation(client, settings.redis_key_prefix, key_id)
    finally:
        client.close()
