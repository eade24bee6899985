"""A Batch API line is billed at the batch price: the price book's price less the batch discount."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from loraplex.billing.events import UsageEvent
from loraplex.billing.ledger import Ledger
from loraplex.billing.models import UsageEventRow
from loraplex.billing.pricing import PriceBook, add_price
from loraplex.platform.db import migrate
from loraplex.platform.db.session import make_db_engine, make_session_factory
from sqlalchemy import select


@pytest.mark.parametrize("discount", [50, 0, 100])
def test_batch_events_cost_the_discounted_price(tmp_path: Path, discount: int) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    migrate.upgrade(url)
    engine = make_db_engine(url)
    sessions = make_session_factory(engine)
    with sessions() as db, db.begin():
        add_price(db, model="m", input_usd_per_mtok="0.15", output_usd_per_mtok="0.61",
                  cached_input_usd_per_mtok="0.07", effective_from=datetime(2020, 1, 1, tzinfo=UTC))
    ledger = Ledger(sessions, PriceBook(sessions, batch_discount_percent=discount))
    common = {"tenant_id": "t", "model": "m", "status": "completed", "created_at": datetime.now(UTC),
              "input_tokens": 1000, "cached_input_tokens": 300, "output_tokens": 77}
    ledger.write([UsageEvent(request_id="online", **common),
                  UsageEvent(request_id="batch_x-1", batch_id="batch_x", **common)])
    with sessions() as db:
        cost = dict(db.execute(select(UsageEventRow.request_id, UsageEventRow.cost_picousd)).all())
    engine.dispose()
    full = 700 * 150_000 + 300 * 70_000 + 77 * 610_000
    assert cost["online"] == full
    assert cost["batch_x-1"] == full * (100 - discount) // 100
