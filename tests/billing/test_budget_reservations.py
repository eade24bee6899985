"""Budgets hold under concurrency: each request reserves its maximum cost at admission and settles it with
its actual usage, atomically, so concurrent requests overspend by at most one reservation; holds of
crashed requests lapse; without Redis the month's spend survives a restart (it lives in the database)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest
from loraplex.billing.ledger import Ledger
from loraplex.billing.models import BillingBase, BudgetSpendRow
from loraplex.billing.quotas import (
    MemorySpendCounter,
    QuotaExceededError,
    QuotaGuard,
    RedisSpendCounter,
    Spend,
    set_budget,
)
from loraplex.billing.spend_counters import SqlSpendCounter
from sqlalchemy import Engine, create_engine, delete
from sqlalchemy.orm import sessionmaker
from waiting import wait_until


def make_engine(url: str) -> Engine:
    return create_engine(url, connect_args={"timeout": 30} if url.startswith("sqlite") else {})


LIMIT = 1000
RESERVATION = Spend(100)    # prompt 20 + max_tokens 80
FLOOR = Spend(20)


@pytest.fixture(params=["redis", "sql", "memory"])
def counter(request, redis_client, key_prefix, session_factory):
    if request.param == "redis":
        return RedisSpendCounter(redis_client, key_prefix)
    return SqlSpendCounter(session_factory) if request.param == "sql" else MemorySpendCounter()


@pytest.fixture
def guard(session_factory, counter) -> QuotaGuard:
    with session_factory() as session, session.begin():
        set_budget(session, tenant_id="ten_a", monthly_token_limit=LIMIT)
    return QuotaGuard(session_factory, counter, budget_cache_s=60)


def _request(guard: QuotaGuard, session_factory, make_event, index: int, barrier: threading.Barrier) -> bool:
    """One request: admitted (reserve) or refused; an admitted one runs a moment, then its event is settled."""
    request_id = f"req_{index}"
    barrier.wait()
    try:
        guard.reserve(request_id=request_id, tenant_id="ten_a", api_key_id="key_a1", amount=RESERVATION,
                      floor=FLOOR)
    except QuotaExceededError:
        return False
    time.sleep(0.01)
    # The worst case: every admitted request uses its whole reservation.
    event = make_event(request_id, input_tokens=20, cached_input_tokens=0, output_tokens=80, thinking_tokens=0)
    result = Ledger(session_factory).write([event])
    guard.settle(result.inserted, result.cost_picousd)
    return True


def test_concurrent_requests_overspend_by_at_most_one_reservation(guard, session_factory, make_event):
    num_requests = 50
    barrier = threading.Barrier(num_requests)
    with ThreadPoolExecutor(num_requests) as pool:
        admitted = list(pool.map(lambda i: _request(guard, session_factory, make_event, i, barrier),
                                 range(num_requests)))
    spent = guard.spend(tenant_id="ten_a").tokens
    assert spent == sum(admitted) * RESERVATION.tokens
    assert LIMIT - RESERVATION.tokens < spent <= LIMIT + RESERVATION.tokens, admitted
    with pytest.raises(QuotaExceededError, match="tokens used or held"):
        guard.reserve(request_id="late", tenant_id="ten_a", api_key_id=None, amount=RESERVATION, floor=FLOOR)


def test_unsettled_reservations_hold_the_budget_until_they_lapse(session_factory, counter):
    with session_factory() as session, session.begin():
        set_budget(session, tenant_id="ten_a", api_key_id="key_a1", monthly_token_limit=250)
    guard = QuotaGuard(session_factory, counter, budget_cache_s=60, reservation_ttl_s=0.5)
    for i in range(3):  # 300 held > 250: the third is the one overspend allowed
        guard.reserve(request_id=f"r{i}", tenant_id="ten_a", api_key_id="key_a1", amount=RESERVATION, floor=FLOOR)
    with pytest.raises(QuotaExceededError, match="API key key_a1"):
        guard.reserve(request_id="r3", tenant_id="ten_a", api_key_id="key_a1", amount=RESERVATION, floor=FLOOR)
    assert guard.spend(tenant_id="ten_a", api_key_id="key_a1") == Spend()  # held, not spent

    def admitted() -> bool:  # the requests "crashed": nothing settles them, their holds lapse after 0.5 s
        try:
            return guard.reserve(request_id="r4", tenant_id="ten_a", api_key_id="key_a1", amount=RESERVATION,
                                 floor=FLOOR)
        except QuotaExceededError:
            return False

    assert wait_until(admitted, timeout_s=10, what="the unsettled reservations to lapse")


def test_a_prompt_that_cannot_fit_is_refused_before_the_budget_is_used_up(guard):
    guard.reserve(request_id="big", tenant_id="ten_a", api_key_id=None, amount=Spend(900), floor=Spend(900))
    with pytest.raises(QuotaExceededError, match="prompt tokens would overrun"):
        guard.reserve(request_id="p", tenant_id="ten_a", api_key_id=None, amount=Spend(200), floor=Spend(150))
    assert guard.reserve(request_id="q", tenant_id="ten_a", api_key_id=None, amount=Spend(200), floor=Spend(50))


def test_no_budget_means_no_reservation(session_factory, counter):
    guard = QuotaGuard(session_factory, counter, budget_cache_s=60)
    assert guard.reserve(request_id="r", tenant_id="ten_free", api_key_id="k", amount=Spend(10**9),
                         floor=Spend(10**9)) is False


def test_without_redis_the_months_spend_survives_a_restart(db_url, make_event):
    """The spend lives in the database: a new process (new engine, new guard) sees it, and start-up
    reconciliation from the ledger restores what a crash between the ledger write and the count lost."""
    now = datetime.now(UTC)
    first = make_engine(db_url)
    BillingBase.metadata.create_all(first)
    factory = sessionmaker(first, expire_on_commit=False)
    with factory() as session, session.begin():
        set_budget(session, tenant_id="ten_a", monthly_token_limit=LIMIT)
    guard = QuotaGuard(factory, SqlSpendCounter(factory))
    events = [make_event(f"r{i}", created_at=now) for i in range(4)]  # 150 tokens each
    result = Ledger(factory).write(events)
    guard.settle(result.inserted, result.cost_picousd)
    first.dispose()

    second = make_engine(db_url)
    factory = sessionmaker(second, expire_on_commit=False)
    restarted = QuotaGuard(factory, SqlSpendCounter(factory))
    assert restarted.spend(tenant_id="ten_a") == Spend(600, sum(result.cost_picousd.values()))
    with factory() as session, session.begin():
        session.execute(delete(BudgetSpendRow))  # as if the counts had never been written
    assert restarted.spend(tenant_id="ten_a").tokens == 0
    restarted.reconcile()
    assert restarted.spend(tenant_id="ten_a").tokens == 600
    assert restarted.spend(tenant_id="ten_a", api_key_id="key_a1").tokens == 600
    restarted.reserve(request_id="more", tenant_id="ten_a", api_key_id=None, amount=Spend(300), floor=Spend(10))
    with pytest.raises(QuotaExceededError, match="900 of 1,000 tokens used or held"):
        restarted.reserve(request_id="again", tenant_id="ten_a", api_key_id=None, amount=Spend(300),
                          floor=Spend(101))
    second.dispose()


def test_a_request_refused_after_its_reservation_gives_it_back(guard):
    guard.reserve(request_id="r1", tenant_id="ten_a", api_key_id="key_a1", amount=Spend(LIMIT), floor=FLOOR)
    with pytest.raises(QuotaExceededError):
        guard.reserve(request_id="r2", tenant_id="ten_a", api_key_id="key_a1", amount=RESERVATION, floor=FLOOR)
    guard.release(request_id="r1", tenant_id="ten_a", api_key_id="key_a1")  # e.g. the rate limiter said no
    assert guard.reserve(request_id="r2", tenant_id="ten_a", api_key_id="key_a1", amount=RESERVATION, floor=FLOOR)
    assert guard.spend(tenant_id="ten_a") == Spend()
