"""The meter: durable before record() completes, one ledger row per request, whatever dies or refuses."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loraplex.billing.ledger import Ledger
from loraplex.billing.meter import Meter, RecentRequestIds
from loraplex.billing.models import UsageEventRow
from loraplex.billing.quotas import MemorySpendCounter, QuotaGuard
from loraplex.billing.spool import FileSpool, RedisStreamSpool
from sqlalchemy import func, select
from sqlalchemy.orm import sessionmaker
from waiting import wait_until


def _ledger_totals(session_factory) -> tuple[int, int, int]:
    e = UsageEventRow
    with session_factory() as session:
        count, tokens, distinct = session.execute(
            select(func.count(), func.sum(e.input_tokens + e.output_tokens), func.count(e.request_id.distinct()))
        ).one()
    return count, int(tokens or 0), distinct


def test_meter_writes_every_event_once(session_factory, make_event, tmp_path):
    meter = Meter(Ledger(session_factory), spools=[FileSpool(tmp_path)])
    meter.start()
    events = [make_event(input_tokens=i + 1, cached_input_tokens=0, output_tokens=i, thinking_tokens=0)
              for i in range(400)]
    for event in events:
        meter.record(event)
    for event in events[:50]:  # a retried write of the same requests
        meter.record(event)
    assert meter.flush()
    meter.close()
    assert _ledger_totals(session_factory) == (400, sum(e.total_tokens for e in events), 400)
    assert meter.stats.num_written == 400 and meter.stats.num_duplicates == 50
    # a usage lookup waits for the writer only for ids this meter recorded, never for made-up ones
    assert meter.recorded_recently(events[7].request_id) and not meter.recorded_recently("req_made_up")


def test_recent_request_ids_forget_by_age_and_by_count():
    recent = RecentRequestIds(window_s=0.2, max_ids=3)
    for request_id in ("a", "b", "c", "d"):
        recent.add(request_id)
    assert "a" not in recent and all(r in recent for r in ("b", "c", "d"))
    time.sleep(0.25)
    assert "d" not in recent
    recent.add("e")
    assert "e" in recent and "b" not in recent


@pytest.mark.parametrize("spool_kind", ["file", "redis"])
def test_events_spooled_while_database_refuses_are_drained_when_it_returns(
    spool_kind, pg_url, pg_session_factory, refusing_engine, make_event, tmp_path, redis_client, key_prefix
):
    # The meter's ledger points at a URL that refuses connections (a stopped database) ...
    factory = sessionmaker(refusing_engine, expire_on_commit=False)
    spool = FileSpool(tmp_path) if spool_kind == "file" else RedisStreamSpool(redis_client, key_prefix)
    counter = MemorySpendCounter()
    guard = QuotaGuard(pg_session_factory, counter)
    meter = Meter(Ledger(factory), spools=[spool], on_recorded=guard.on_recorded, retry_interval_s=0.1)
    meter.start()
    during_outage = [make_event(f"out{i}") for i in range(120)]
    durable = [meter.record(event) for event in during_outage]
    assert meter.flush()
    assert all(future.done() for future in durable)
    wait_until(lambda: not meter.db_available, what="the meter to notice the database is down")
    assert spool.num_pending() == 120
    assert meter.stats.num_written == 0
    # ... then the database comes back (the URL is fixed): the spool drains into it, nothing twice.
    factory.configure(bind=pg_session_factory.kw["bind"])
    for event in [*during_outage[:10], make_event("after")]:  # replays of spooled events and a new one
        meter.record(event)
    wait_until(lambda: meter.db_available and meter.num_pending_spooled() == 0,
               what="the meter to write its spool to the database")
    assert meter.flush()
    meter.close()
    count, tokens, distinct = _ledger_totals(pg_session_factory)
    assert count == distinct == 121
    assert tokens == 121 * 150
    assert counter.get(during_outage[0].created_at.strftime("%Y-%m"), "ten_a", "").tokens == 121 * 150, (
        "quota spending counts each request once, replays included"
    )


def test_unwritten_spool_left_by_a_dead_process_is_drained_on_start(session_factory, make_event, tmp_path):
    dead = FileSpool(tmp_path)
    dead.append([make_event(f"left{i}") for i in range(30)])
    dead.close()
    meter = Meter(Ledger(session_factory), spools=[FileSpool(tmp_path)])
    meter.start()
    wait_until(lambda: _ledger_totals(session_factory)[0] == 30, what=lambda: _ledger_totals(session_factory))
    meter.close()
    assert meter.num_pending_spooled() == 0


def test_falls_back_to_the_next_spool_when_the_first_fails(refusing_engine, make_event, tmp_path):
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    unreachable = redis.Redis(port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    broken_redis = RedisStreamSpool(unreachable, "x:")
    file_spool = FileSpool(tmp_path)
    meter = Meter(Ledger(sessionmaker(refusing_engine)), spools=[broken_redis, file_spool])
    meter.start()
    meter.record(make_event("only"))
    assert meter.flush()
    meter.close()
    assert file_spool.num_pending() == 1


@pytest.mark.parametrize("spool_kind", ["file", "redis"])
def test_events_durable_in_a_sigkilled_process_reach_the_ledger_once(
    spool_kind, pg_session_factory, tmp_path, redis_url, redis_client, key_prefix
):
    """record() has returned, the database was down, then SIGKILL: the next process writes them, once."""
    where = str(tmp_path) if spool_kind == "file" else redis_url
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("journal_child.py")), spool_kind, where, key_prefix, "40"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "durable", child.stderr.read()
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert child.returncode == -signal.SIGKILL
        spool = FileSpool(tmp_path) if spool_kind == "file" else RedisStreamSpool(redis_client, key_prefix, lease_s=0.5)
        meter = Meter(Ledger(pg_session_factory), spools=[spool], keep_alive_interval_s=0.1)
        meter.start()
        wait_until(lambda: _ledger_totals(pg_session_factory)[0] == 40 and meter.num_pending_spooled() == 0)
        meter.close()
    finally:
        child.kill()
    assert _ledger_totals(pg_session_factory) == (40, 40 * 150, 40)
    if spool_kind == "redis":
        assert not list(redis_client.scan_iter(match=f"{key_prefix}billing:journal*")), "drained journals retired"


def test_redis_journal_of_a_live_process_is_left_alone(redis_client, key_prefix, make_event):
    alive = RedisStreamSpool(redis_client, key_prefix, lease_s=0.4)
    other = RedisStreamSpool(redis_client, key_prefix, lease_s=0.4)
    alive.append([make_event(f"a{i}") for i in range(3)])
    for _ in range(4):  # keep-alives more often than the lease: never adopted
        alive.keep_alive()
        assert other.peek(10) is None
        time.sleep(0.15)
    # the owner stops renewing (it died): once its lease runs out the other process takes over
    batch = wait_until(lambda: other.peek(10), timeout_s=10, what="the other process to adopt the journal")
    assert [e.request_id for e in batch.events] == ["a0", "a1", "a2"]
    other.ack(batch)
    assert other.peek(10) is None
    # The stalled owner comes back and appends again: its stream is registered anew, never orphaned.
    alive.append([make_event("late")])
    batch = wait_until(lambda: other.peek(10), timeout_s=10, what="the other process to adopt the late journal")
    assert [e.request_id for e in batch.events] == ["late"]


def test_close_releases_an_unwritten_journal_at_once(redis_client, key_prefix, make_event):
    leaving = RedisStreamSpool(redis_client, key_prefix, lease_s=60)
    leaving.append([make_event("left")])
    leaving.close()
    assert [e.request_id for e in RedisStreamSpool(redis_client, key_prefix).peek(5).events] == ["left"]


def test_an_event_recorded_after_close_is_still_journaled(session_factory, make_event, tmp_path):
    """A request that ends during shutdown must neither hang on its future nor lose its event."""
    spool = FileSpool(tmp_path)
    meter = Meter(Ledger(session_factory), spools=[spool])
    meter.start()
    meter.close()
    late = meter.record(make_event("late"))
    assert late.done()
    reader = FileSpool(tmp_path)  # the next process
    assert [e.request_id for e in reader.peek(5).events] == ["late"]


def test_a_cancelled_waiter_neither_stops_the_journal_nor_loses_its_event(session_factory, make_event, tmp_path):
    """The platform awaits each record through asyncio.wrap_future; a request cancelled meanwhile (its client
    left) cancels that wrapper. Its event is still journaled and written, and later records still complete."""
    import asyncio

    meter = Meter(Ledger(session_factory), spools=[FileSpool(tmp_path)])
    meter.start()

    async def cancelled_then_more() -> None:
        waiter = asyncio.ensure_future(asyncio.wrap_future(meter.record(make_event("cancelled"))))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        for i in range(3):
            await asyncio.wait_for(asyncio.wrap_future(meter.record(make_event(f"after{i}"))), timeout=10)

    asyncio.run(cancelled_then_more())
    assert meter.flush() and meter.wait_written()
    meter.close()
    assert _ledger_totals(session_factory)[0] == 4
