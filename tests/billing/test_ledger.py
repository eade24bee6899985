"""The ledger writes each request id once and prices it at the price in force."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from loraplex.billing.ledger import Ledger, LedgerUnavailableError
from loraplex.billing.models import RolledUpDayRow, UsageEventRow
from loraplex.billing.pricing import PriceBook, add_price
from loraplex.billing.rollups import rollup_day
from sqlalchemy import func, select
from sqlalchemy.orm import sessionmaker


def _count(session_factory) -> int:
    with session_factory() as session:
        return session.scalar(select(func.count()).select_from(UsageEventRow))


def test_replayed_batch_inserts_nothing_twice(session_factory, make_event):
    ledger = Ledger(session_factory)
    events = [make_event() for _ in range(20)]
    first = ledger.write(events)
    assert len(first.inserted) == 20 and not first.duplicates
    again = ledger.write([*events[5:], make_event("req_new")])
    assert [e.request_id for e in again.inserted] == ["req_new"]
    assert len(again.duplicates) == 15
    assert _count(session_factory) == 21


def test_duplicate_inside_one_batch_is_written_once(session_factory, make_event):
    ledger = Ledger(session_factory)
    event = make_event("req_dup")
    result = ledger.write([event, event, make_event("req_other")])
    assert sorted(e.request_id for e in result.inserted) == ["req_dup", "req_other"]
    assert _count(session_factory) == 2


def test_concurrent_writers_of_overlapping_batches_store_each_request_once(pg_session_factory, make_event):
    ledger = Ledger(pg_session_factory)
    events = [make_event(f"req_{i}") for i in range(300)]
    inserted: list[str] = []
    lock = threading.Lock()

    def writer(offset: int) -> None:
        for start in range(offset, 300, 50):
            result = ledger.write(events[start:start + 100])
            with lock:
                inserted.extend(e.request_id for e in result.inserted)

    threads = [threading.Thread(target=writer, args=(k * 25,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(inserted) == sorted(e.request_id for e in events[0:300])
    assert _count(pg_session_factory) == 300


def test_cost_uses_the_most_specific_price_in_force_at_event_time(session_factory, make_event):
    t0 = datetime(2026, 10, 1, tzinfo=UTC)
    with session_factory() as session, session.begin():
        add_price(session, model="*", input_usd_per_mtok="1", output_usd_per_mtok="2", effective_from=t0)
        add_price(session, model="smollm2", input_usd_per_mtok="0.5", cached_input_usd_per_mtok="0.25",
                  output_usd_per_mtok="1.5", thinking_usd_per_mtok="3", effective_from=t0)
        add_price(session, model="smollm2", input_usd_per_mtok="0.6", output_usd_per_mtok="1.8",
                  effective_from=t0 + timedelta(days=30))
        add_price(session, model="smollm2", adapter_id="ad_x", input_usd_per_mtok="5",
                  output_usd_per_mtok="5", effective_from=t0)
    ledger = Ledger(session_factory, PriceBook(session_factory))
    early = make_event("early", created_at=t0 + timedelta(days=1))
    late = make_event("late", created_at=t0 + timedelta(days=31))
    adapter = make_event("adapter", created_at=t0 + timedelta(days=1), adapter_id="ad_x")
    other_model = make_event("other", created_at=t0 + timedelta(days=1), model="llama")
    before_any = make_event("before", created_at=t0 - timedelta(days=1))
    result = ledger.write([early, late, adapter, other_model, before_any])
    # 80 uncached input, 20 cached, 40 answer, 10 thinking (micro-USD per Mtok == pico-USD per token)
    assert result.cost_picousd == {
        "early": 80 * 500_000 + 20 * 250_000 + 40 * 1_500_000 + 10 * 3_000_000,
        "late": 80 * 600_000 + 20 * 600_000 + 40 * 1_800_000 + 10 * 1_800_000,
        "adapter": 100 * 5_000_000 + 50 * 5_000_000,
        "other": 100 * 1_000_000 + 50 * 2_000_000,
        "before": 0,
    }
    with session_factory() as session:
        stored = dict(session.execute(select(UsageEventRow.request_id, UsageEventRow.cost_picousd)).all())
        priced = dict(session.execute(select(UsageEventRow.request_id, UsageEventRow.price_id)).all())
    assert stored == result.cost_picousd
    assert priced["before"] is None and priced["early"] != priced["late"]


def test_late_event_marks_its_closed_day_stale(session_factory, make_event):
    ledger = Ledger(session_factory)
    yesterday = datetime.now(UTC) - timedelta(days=1)
    ledger.write([make_event("a", created_at=yesterday)])
    rollup_day(session_factory, yesterday.date())
    with session_factory() as session:
        assert session.get(RolledUpDayRow, yesterday.date()) is not None
    ledger.write([make_event("b", created_at=yesterday)])
    with session_factory() as session:
        assert session.get(RolledUpDayRow, yesterday.date()) is None


def test_unreachable_database_raises_unavailable(make_event, refusing_engine):
    ledger = Ledger(sessionmaker(refusing_engine))
    with pytest.raises(LedgerUnavailableError):
        ledger.write([make_event()])


def test_price_book_serves_its_last_read_through_a_database_outage(session_factory, refusing_engine):
    """Admission prices each reservation from the book; an expired cache during an outage must not turn
    every request into a 500. A book never read has nothing to fall back on and says so."""
    with session_factory() as session, session.begin():
        add_price(session, model="*", input_usd_per_mtok="1", output_usd_per_mtok="2",
                  effective_from=datetime(2026, 1, 1, tzinfo=UTC))
    current = [session_factory]
    book = PriceBook(lambda: current[0](), ttl_s=0.0)
    read = book.prices()
    assert [p.model for p in read] == ["*"]
    current[0] = sessionmaker(bind=refusing_engine)
    assert book.prices() == read
    with pytest.raises(Exception) as raised:
        PriceBook(sessionmaker(bind=refusing_engine)).prices()
    assert "OperationalError" in type(raised.value).__name__
