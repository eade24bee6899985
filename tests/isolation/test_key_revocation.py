"""A revoked key stops working everywhere at once (with Redis), and is never served from a stale cache
during a database outage unless its revocation state is certain."""

from __future__ import annotations

import httpx
import pytest
from loraplex.platform.auth import store
from loraplex.platform.auth.key_cache import KeyCache
from loraplex.platform.auth.revocation import RedisRevocationFeed, announce_if_configured
from loraplex.platform.db.session import make_db_engine, make_session_factory
from waiting import wait_until


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_revocation_reaches_another_process_at_once_and_is_never_served_stale(redis_url, key_prefix):
    here: KeyCache[str] = KeyCache(fresh_s=60, stale_s=900)
    there: KeyCache[str] = KeyCache(fresh_s=60, stale_s=900)
    feeds = [RedisRevocationFeed(redis_url, key_prefix, cache) for cache in (here, there)]
    for feed in feeds:
        feed.start()
    try:
        assert all(feed.healthy for feed in feeds)
        there.put("hash-1", "key_1", "principal")
        there.put("hash-2", "key_2", "other")
        here.forget_key("key_1")  # the admin route's revocation in this process
        wait_until(lambda: there.fresh("hash-1") is None, timeout_s=1.0, interval_s=0.005,
                   what="the revocation to reach the other process")
        assert there.stale("hash-1") is None  # the database being down changes nothing
        there.put("hash-1", "key_1", "principal")  # a racing lookup that read the row just before it changed
        assert there.fresh("hash-1") is None
        assert there.fresh("hash-2") == "other"

        late: KeyCache[str] = KeyCache(fresh_s=60, stale_s=900)
        late_feed = RedisRevocationFeed(redis_url, key_prefix, late)
        late_feed.start()  # a process started after the announcement knows it from the set
        try:
            late.put("hash-1", "key_1", "principal")
            assert late.fresh("hash-1") is None and late.stale("hash-1") is None
        finally:
            late_feed.stop()
    finally:
        for feed in feeds:
            feed.stop()


def test_without_a_feed_stale_entries_serve_only_keys_confirmed_just_before_the_outage():
    clock = Clock()
    cache: KeyCache[str] = KeyCache(fresh_s=5, stale_s=900, clock=clock)
    cache.put("old", "key_old", "rarely used")   # confirmed at t=1000
    clock.now += 100
    cache.put("busy", "key_busy", "in use")       # t=1100: the database's last answer
    clock.now += 2
    cache.put("busy2", "key_busy2", "in use too")  # t=1102
    clock.now += 300                              # the database has been down since t=1102
    assert cache.stale("busy") == "in use" and cache.stale("busy2") == "in use too"
    # Revoked (by another process) before the outage and not looked up since: its state is unknown.
    assert cache.stale("old") is None


class HealthyFeed:
    healthy = True
    announced: list[str]

    def __init__(self) -> None:
        self.announced = []

    def announce(self, key_id: str) -> None:
        self.announced.append(key_id)


def test_with_a_healthy_feed_stale_entries_serve_every_key_not_revoked():
    clock = Clock()
    cache: KeyCache[str] = KeyCache(fresh_s=5, stale_s=900, clock=clock)
    feed = HealthyFeed()
    cache.feed = feed
    cache.put("old", "key_old", "rarely used")
    clock.now += 100
    cache.put("busy", "key_busy", "in use")
    clock.now += 300
    assert cache.stale("old") == "rarely used"
    cache.forget_key("key_old")
    assert cache.stale("old") is None and feed.announced == ["key_old"]
    clock.now += 700
    assert cache.stale("busy") is None  # past stale_s: gone whatever the feed says


@pytest.fixture(scope="module")
def redis_server(start_server, redis_url, redis_prefix):
    with start_server(redis_url=redis_url, redis_key_prefix=f"{redis_prefix}revocation:", key_cache_fresh_s=60) as s:
        yield s


def test_a_key_revoked_from_the_cli_stops_working_on_a_running_server_at_once(redis_server):
    server = redis_server
    headers = {"Authorization": f"Bearer {server.keys['inference']}"}
    assert httpx.get(f"{server.base_url}/v1/models", headers=headers).status_code == 200  # now cached for 60 s
    # What `loraplex keys revoke` does from another process: the database row, then the announcement.
    db_engine = make_db_engine(server.settings.resolved_database_url)
    with make_session_factory(db_engine)() as db:
        assert store.revoke_api_key(db, key_id=server.key_ids["inference"]) is not None
    db_engine.dispose()
    announce_if_configured(server.settings, server.key_ids["inference"])
    # within a second, not the 60 s the cache would otherwise keep it
    wait_until(lambda: httpx.get(f"{server.base_url}/v1/models", headers=headers).status_code == 401,
               timeout_s=1.0, interval_s=0.005, what="the revoked key to be refused")
