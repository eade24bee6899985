"""Budgets refuse work once spent (429 error type), per tenant and per key; a new month starts fresh."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from loraplex.billing.ledger import Ledger
from loraplex.billing.pricing import add_price
from loraplex.billing.quotas import (
    MemorySpendCounter,
    QuotaExceededError,
    QuotaGuard,
    RedisSpendCounter,
    set_budget,
)
from loraplex.platform.errors import status_for

NOV = datetime(2026, 11, 20, 12, tzinfo=UTC)
DEC = datetime(2026, 12, 1, 0, 0, 1, tzinfo=UTC)


@pytest.fixture(params=["redis", "memory"])
def counter(request, redis_client, key_prefix):
    return RedisSpendCounter(redis_client, key_prefix) if request.param == "redis" else MemorySpendCounter()


def _spend(session_factory, guard, events):
    result = Ledger(session_factory).write(events)
    guard.on_recorded(result.inserted, result.cost_picousd)


def test_tenant_token_budget_refuses_with_429_and_resets_next_month(session_factory, counter, make_event):
    guard = QuotaGuard(session_factory, counter, budget_cache_s=0)
    with session_factory() as session, session.begin():
        set_budget(session, tenant_id="ten_a", monthly_token_limit=1000)
    guard.check(tenant_id="ten_a", api_key_id="key_a1", now=NOV)
    _spend(session_factory, guard, [make_event(f"r{i}", created_at=NOV) for i in range(6)])  # 900 tokens
    guard.check(tenant_id="ten_a", api_key_id="key_a1", estimated_tokens=100, now=NOV)
    with pytest.raises(QuotaExceededError) as raised:
        guard.check(tenant_id="ten_a", api_key_id="key_a1", estimated_tokens=101, now=NOV)
    assert status_for(raised.value) == 429  # the platform's error table; billing knows no HTTP
    assert "900 of 1,000 tokens" in raised.value.message and "2026-12-01" in raised.value.message
    _spend(session_factory, guard, [make_event("r6", created_at=NOV, input_tokens=50, cached_input_tokens=0,
                                               output_tokens=50, thinking_tokens=0)])  # exactly 1,000: spent
    with pytest.raises(QuotaExceededError):
        guard.check(tenant_id="ten_a", api_key_id=None, now=NOV)
    guard.check(tenant_id="ten_b", api_key_id=None, now=NOV)  # another tenant is unaffected
    guard.check(tenant_id="ten_a", api_key_id="key_a1", now=DEC)  # a new month starts from zero


def test_key_limit_and_cost_budget(session_factory, counter, make_event):
    guard = QuotaGuard(session_factory, counter, budget_cache_s=0)
    with session_factory() as session, session.begin():
        add_price(session, model="*", input_usd_per_mtok="1000", output_usd_per_mtok="1000",
                  effective_from=datetime(2020, 1, 1, tzinfo=UTC))
        set_budget(session, tenant_id="ten_a", api_key_id="key_a1", monthly_token_limit=200)
        set_budget(session, tenant_id="ten_a", monthly_cost_limit_usd="0.40")
    _spend(session_factory, guard, [make_event("k1", api_key_id="key_a1", created_at=NOV),
                                    make_event("k2", api_key_id="key_a2", created_at=NOV)])
    with pytest.raises(QuotaExceededError, match="API key key_a1"):
        guard.check(tenant_id="ten_a", api_key_id="key_a1", estimated_tokens=51, now=NOV)
    guard.check(tenant_id="ten_a", api_key_id="key_a2", estimated_tokens=51, now=NOV)
    _spend(session_factory, guard, [make_event("k3", api_key_id="key_a2", created_at=NOV)])  # $0.45 of $0.40
    with pytest.raises(QuotaExceededError, match=r"monthly cost budget of tenant ten_a"):
        guard.check(tenant_id="ten_a", api_key_id="key_a2", now=NOV)


def test_reconcile_restores_counters_from_the_ledger(session_factory, counter, make_event):
    guard = QuotaGuard(session_factory, counter, budget_cache_s=0)
    Ledger(session_factory).write([make_event(f"r{i}", created_at=NOV) for i in range(4)])  # never counted
    assert guard.spend(tenant_id="ten_a", month="2026-11").tokens == 0
    assert guard.reconcile(month="2026-11") == 2  # the tenant and its key
    assert guard.spend(tenant_id="ten_a", month="2026-11").tokens == 600
    assert guard.spend(tenant_id="ten_a", api_key_id="key_a1", month="2026-11").tokens == 600


def test_an_estimate_that_would_overrun_is_refused_and_one_that_fits_is_not(session_factory, counter, make_event):
    guard = QuotaGuard(session_factory, counter, budget_cache_s=0)
    with session_factory() as session, session.begin():
        set_budget(session, tenant_id="ten_a", monthly_token_limit=1000, monthly_cost_limit_usd="0.000001")
    guard.check(tenant_id="ten_a", api_key_id=None, estimated_tokens=1000, estimated_cost_picousd=10**6, now=NOV)
    with pytest.raises(QuotaExceededError, match=r"1,001 prompt tokens would overrun .* 1,000 left"):
        guard.check(tenant_id="ten_a", api_key_id=None, estimated_tokens=1001, now=NOV)
    with pytest.raises(QuotaExceededError, match=r"would overrun the monthly cost budget of tenant ten_a"):
        guard.check(tenant_id="ten_a", api_key_id=None, estimated_tokens=10, estimated_cost_picousd=10**6 + 1, now=NOV)
