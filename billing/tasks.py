"""The periodic billing task (Celery beat runs it; see platform/celery_app.py).

Plain function of plain arguments, so it runs the same in a worker, eagerly,
or from a test: roll up every closed day that needs it, then reset this
month's (and, early in a month, last month's) quota counters from the ledger.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from loraplex.billing.quotas import MemorySpendCounter, QuotaGuard, RedisSpendCounter, SpendCounter, month_of
from loraplex.billing.rollups import rollup_pending_days
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker


def rollup_and_reconcile(
    database_url: str, redis_url: str | None = None, key_prefix: str = "lpx:", now: str | None = None
) -> dict[str, Any]:
    moment = datetime.fromisoformat(now) if now else datetime.now(UTC)
    engine = create_engine(database_url, pool_pre_ping=True)
    client = None
    try:
        factory = sessionmaker(engine, expire_on_commit=False)
        days = rollup_pending_days(factory, now=moment)
        counter: SpendCounter = MemorySpendCounter()
        if redis_url:
            import redis

            client = redis.Redis.from_url(redis_url)
            counter = RedisSpendCounter(client, key_prefix)
        guard = QuotaGuard(factory, counter)
        months = sorted({month_of(moment), month_of(moment - timedelta(days=3))})
        reconciled = sum(guard.reconcile(month=month) for month in months) if redis_url else 0
        return {"rolled_up_days": [d.isoformat() for d in days], "reconciled_counters": reconciled}
    finally:
        if client is not None:
            client.close()
        engine.dispose()
