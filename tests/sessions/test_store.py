"""SessionStore semantics, identical for the Redis and the in-process implementation."""

from __future__ import annotations

import threading
import time

import pytest
from loraplex.platform.errors import status_for
from loraplex.sessions.errors import SessionBusyError, SessionConflictError, SessionNotFoundError
from loraplex.sessions.store import KVState, SessionRecord, TurnResult, new_session_id
from waiting import wait_until


def _new(store, tenant: str = "ten_a", **kw) -> SessionRecord:
    return store.create(SessionRecord(id=new_session_id(), tenant_id=tenant, model="smollm2", **kw))


def _turn(user: str, answer: str, tokens: list[int]) -> TurnResult:
    return TurnResult(
        new_messages=[{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
        prefix_token_ids=tokens, prompt_tokens=len(tokens) - 1, cached_tokens=3, replica_id="r0",
    )


def test_create_get_and_tenant_isolation(store):
    created = _new(store, system="be brief", tools=[{"type": "function", "function": {"name": "f"}}])
    got = store.get("ten_a", created.id)
    assert got.system == "be brief" and got.tools[0]["function"]["name"] == "f"
    assert got.version == 0 and got.kv_state == KVState.NONE and got.messages == []
    assert got.expires_at == pytest.approx(time.time() + 3600, abs=5)
    for call in (lambda: store.get("ten_b", created.id), lambda: store.delete("ten_b", created.id),
                 lambda: store.begin_turn("ten_b", created.id), lambda: store.get("ten_a", "sess_nope")):
        with pytest.raises(SessionNotFoundError) as raised:
            call()
        assert status_for(raised.value) == 404
    assert store.get("ten_a", created.id).id == created.id, "the other tenant's attempts changed nothing"


def test_turn_appends_transcript_and_bumps_version(store):
    session = _new(store)
    lease = store.begin_turn("ten_a", session.id)
    after = store.complete_turn(lease, _turn("hi", "hello", [1, 2, 3, 4]))
    assert after.version == 1 and after.num_turns == 1
    lease = store.begin_turn("ten_a", session.id)
    assert lease.session.version == 1
    store.complete_turn(lease, _turn("more", "sure", [1, 2, 3, 4, 5, 6]))
    got = store.get("ten_a", session.id)
    assert [m["content"] for m in got.messages] == ["hi", "hello", "more", "sure"]
    assert got.prefix_token_ids == [1, 2, 3, 4, 5, 6] and got.num_tokens == 6
    assert got.kv_state == KVState.PINNED and got.replica_id == "r0" and got.last_cached_tokens == 3


def test_concurrent_turns_one_wins_the_rest_are_busy(store):
    session = _new(store)
    outcomes: list[str] = []
    start = threading.Barrier(8)
    # The winner holds its lease until every thread has tried: a fixed sleep let a
    # thread scheduled late on a loaded box start after the winner had finished.
    all_tried = threading.Barrier(8)

    def attempt() -> None:
        start.wait(timeout=30)
        try:
            lease = store.begin_turn("ten_a", session.id)
        except SessionBusyError as busy:
            assert status_for(busy) == 409
            outcomes.append("busy")
            all_tried.wait(timeout=30)
            return
        all_tried.wait(timeout=30)
        store.complete_turn(lease, _turn("q", "a", [1, 2]))
        outcomes.append("done")

    threads = [threading.Thread(target=attempt) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["busy"] * 7 + ["done"]
    got = store.get("ten_a", session.id)
    assert got.version == 1 and len(got.messages) == 2


def test_aborted_turn_records_nothing_and_frees_the_session(store):
    session = _new(store)
    store.abort_turn(store.begin_turn("ten_a", session.id))
    assert store.get("ten_a", session.id).messages == []
    store.complete_turn(store.begin_turn("ten_a", session.id), _turn("q", "a", [1]))
    assert store.get("ten_a", session.id).version == 1


def test_turn_whose_lease_was_taken_over_is_refused(store):
    session = _new(store)
    slow = store.begin_turn("ten_a", session.id, lease_s=0.1)
    fast = wait_until(lambda: store.begin_turn("ten_a", session.id), timeout_s=10, ignoring=(SessionBusyError,),
                      what="the slow turn's lease to run out")
    store.complete_turn(fast, _turn("fast", "a", [1]))
    with pytest.raises(SessionConflictError) as raised:
        store.complete_turn(slow, _turn("slow", "b", [2]))
    assert status_for(raised.value) == 409
    assert [m["content"] for m in store.get("ten_a", session.id).messages] == ["fast", "a"]


def test_lease_that_ran_out_untaken_still_completes(store):
    session = _new(store)
    lease = store.begin_turn("ten_a", session.id, lease_s=0.05)
    time.sleep(0.1)
    assert store.complete_turn(lease, _turn("q", "a", [1])).version == 1


def test_delete_during_a_turn_refuses_its_completion(store):
    session = _new(store)
    lease = store.begin_turn("ten_a", session.id)
    removed = store.delete("ten_a", session.id)
    assert removed.id == session.id
    with pytest.raises(SessionNotFoundError):
        store.complete_turn(lease, _turn("q", "a", [1]))
    with pytest.raises(SessionNotFoundError):
        store.get("ten_a", session.id)


def test_list_is_paginated_newest_first_and_per_tenant(store):
    ids = [_new(store, created_at=1000.0 + k).id for k in range(7)]
    _new(store, tenant="ten_b")
    store.delete("ten_a", ids[3])
    expected = [i for i in reversed(ids) if i != ids[3]]
    page1 = store.list("ten_a", limit=4)
    page2 = store.list("ten_a", limit=4, after=page1.last_id)
    assert [r.id for r in page1.data] == expected[:4] and page1.has_more
    assert [r.id for r in page2.data] == expected[4:] and not page2.has_more
    assert store.list("ten_a", after="sess_unknown").data == []


def test_ttl_expiry_and_refresh_on_each_turn(store):
    short = _new(store, ttl_seconds=1)
    kept = _new(store, ttl_seconds=2)
    time.sleep(1.2)
    store.complete_turn(store.begin_turn("ten_a", kept.id), _turn("q", "a", [1]))  # pushes expiry to now+2s
    with pytest.raises(SessionNotFoundError):
        store.get("ten_a", short.id)
    time.sleep(1.2)
    assert store.get("ten_a", kept.id).version == 1, "the turn refreshed the TTL"
    assert [r.id for r in store.list("ten_a").data] == [kept.id]
    assert store.pop_expired() == [short.id]
    assert store.pop_expired() == [], "each expired session is reported once"


def test_running_turn_outlives_the_ttl(store):
    session = _new(store, ttl_seconds=1)
    lease = store.begin_turn("ten_a", session.id, lease_s=5)
    time.sleep(1.3)
    assert store.complete_turn(lease, _turn("q", "a", [1])).version == 1
    assert store.get("ten_a", session.id).expires_at == pytest.approx(time.time() + 1, abs=0.5)


def test_kv_state_updates(store):
    session = _new(store)
    store.complete_turn(store.begin_turn("ten_a", session.id), _turn("q", "a", [1]))
    store.set_kv_state(session.id, KVState.OFFLOADED)
    assert store.get("ten_a", session.id).kv_state == KVState.OFFLOADED
    store.set_kv_state("sess_gone", KVState.DROPPED)  # a gone session: nothing to do
    with pytest.raises(ValueError):
        store.set_kv_state(session.id, "melted")


def test_live_sessions_per_tenant_are_capped_atomically_and_expired_or_deleted_ones_free_room(store):
    from loraplex.sessions.errors import SessionLimitError

    def create(tenant: str, ttl: int = 3600) -> SessionRecord:
        return store.create(SessionRecord(id=new_session_id(), tenant_id=tenant, model="smollm2", ttl_seconds=ttl),
                            max_per_tenant=3)

    short = create("ten_cap", ttl=1)
    kept = [create("ten_cap"), create("ten_cap")]
    with pytest.raises(SessionLimitError) as raised:
        create("ten_cap")
    assert status_for(raised.value) == 429 and raised.value.code == "session_limit_exceeded"
    assert "max_sessions_per_tenant" in str(raised.value)
    create("ten_other")  # another tenant's count is its own
    store.delete("ten_cap", kept[0].id)
    create("ten_cap")  # a deleted session frees its place
    time.sleep(1.2)
    create("ten_cap")  # so does an expired one
    assert short.id not in {r.id for r in store.list("ten_cap", limit=10).data}

    outcomes: list[str] = []
    barrier = threading.Barrier(6)

    def attempt() -> None:
        barrier.wait()
        try:
            create("ten_race")
            outcomes.append("created")
        except SessionLimitError:
            outcomes.append("refused")

    threads = [threading.Thread(target=attempt) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["created"] * 3 + ["refused"] * 3
