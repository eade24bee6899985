"""The key cache: fresh entries skip the database, stale ones stand in only while it is unreachable."""

from __future__ import annotations

import time

import httpx
from loraplex.platform.auth import store
from loraplex.platform.auth.key_cache import KeyCache
from loraplex.platform.db.session import make_db_engine, make_session_factory


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_fresh_then_stale_then_gone():
    clock = Clock()
    cache: KeyCache[str] = KeyCache(fresh_s=5, stale_s=60, clock=clock)
    cache.put("h1", "key_1", "principal-1")
    assert cache.fresh("h1") == "principal-1"
    clock.now += 6
    assert cache.fresh("h1") is None
    assert cache.stale("h1") == "principal-1"
    clock.now += 60
    assert cache.stale("h1") is None
    assert cache.fresh("unknown") is None and cache.stale("unknown") is None


def test_forget_key_drops_every_entry_of_that_key_and_bounded_size():
    cache: KeyCache[str] = KeyCache(fresh_s=5, stale_s=60, max_entries=2)
    cache.put("h1", "key_1", "a")
    cache.put("h2", "key_2", "b")
    cache.forget_key("key_1")
    assert cache.fresh("h1") is None and cache.stale("h1") is None and cache.fresh("h2") == "b"
    cache.put("h3", "key_3", "c")
    cache.put("h4", "key_4", "d")  # over the bound: the oldest goes
    assert cache.fresh("h2") is None and cache.fresh("h4") == "d"


def test_dropping_a_changed_key_is_not_revoking_it():
    # a tenant's weight changed: its keys are read afresh, and cached (and served in an outage) as before
    cache: KeyCache[str] = KeyCache(fresh_s=5, stale_s=60)
    cache.put("h1", "key_1", "weight 1")
    cache.drop_entries("key_1")
    assert cache.fresh("h1") is None
    cache.put("h1", "key_1", "weight 2")
    assert cache.fresh("h1") == "weight 2" and cache.stale("h1") == "weight 2"


def test_zero_fresh_time_disables_the_cache():
    cache: KeyCache[str] = KeyCache(fresh_s=0, stale_s=0)
    cache.put("h1", "key_1", "a")
    assert cache.fresh("h1") is None and cache.stale("h1") is None


def test_key_revoked_by_another_process_stops_working_within_the_fresh_time(start_server):
    with start_server(key_cache_fresh_s=1.0) as server:
        base, key, key_id = server.base_url, server.keys["inference"], server.key_ids["inference"]
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.get(f"{base}/v1/models", headers=headers).status_code == 200
        # Another process (the CLI, another replica) revokes the key straight in the database.
        db_engine = make_db_engine(server.settings.resolved_database_url)
        with make_session_factory(db_engine)() as db:
            assert store.revoke_api_key(db, key_id=key_id) is not None
        db_engine.dispose()
        assert httpx.get(f"{base}/v1/models", headers=headers).status_code == 200, "cached: no DB round trip"
        time.sleep(1.2)
        refused = httpx.get(f"{base}/v1/models", headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
