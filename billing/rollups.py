"""Daily rollups: usage per tenant × day × model × adapter × API key, recomputed idempotently.

`rollup_day` replaces a day's rollup rows with a fresh aggregate of its raw
events in one transaction and marks the day as rolled up; running it twice
gives the same rows. The ledger un-marks a closed day when a late event lands
in it (e.g. drained from the spool), and `rollup_pending_days` — the task the
platform's Celery beat schedules — recomputes every closed day not marked.
"""

from __future__ import annotations

import zlib
from datetime import UTC, date, datetime

from loraplex.billing.models import NONE_KEY, DailyUsageRow, RolledUpDayRow, UsageEventRow
from sqlalchemy import delete, func, insert, literal, literal_column, select, text
from sqlalchemy.orm import Session, sessionmaker

_LOCK_KEY = zlib.crc32(b"loraplex.billing.rollups")


def rollup_day(session_factory: sessionmaker[Session], day: date) -> int:
    """Recompute one day's rollups from its raw events; returns the number of events rolled up."""
    e = UsageEventRow
    # Literal '' (not a bind parameter) so the SELECT and GROUP BY expressions are identical to PostgreSQL.
    adapter = func.coalesce(e.adapter_id, literal_column(f"'{NONE_KEY}'"))
    api_key = func.coalesce(e.api_key_id, literal_column(f"'{NONE_KEY}'"))
    aggregate = (
        select(
            literal(day, DailyUsageRow.day.type).label("day"),
            e.tenant_id,
            e.model,
            adapter,
            api_key,
            func.sum(e.input_tokens),
            func.sum(e.cached_input_tokens),
            func.sum(e.output_tokens),
            func.sum(e.thinking_tokens),
            func.count(),
            func.sum(e.cost_picousd),
        )
        .where(e.day == day)
        .group_by(e.tenant_id, e.model, adapter, api_key)
    )
    d = DailyUsageRow
    columns = [
        d.day, d.tenant_id, d.model, d.adapter_id, d.api_key_id, d.input_tokens, d.cached_input_tokens,
        d.output_tokens, d.thinking_tokens, d.requests, d.cost_picousd,
    ]
    with session_factory() as session, session.begin():
        _lock_rollups(session)
        session.execute(delete(DailyUsageRow).where(DailyUsageRow.day == day))
        session.execute(insert(DailyUsageRow).from_select([c.key for c in columns], aggregate))
        num_events = session.scalar(select(func.count()).select_from(e).where(e.day == day)) or 0
        session.execute(delete(RolledUpDayRow).where(RolledUpDayRow.day == day))
        session.add(RolledUpDayRow(day=day, computed_at=datetime.now(UTC), num_events=num_events))
    return num_events


def pending_days(session: Session, *, today: date) -> list[date]:
    """Closed days that have events but no current rollup."""
    rolled = select(RolledUpDayRow.day)
    query = (
        select(UsageEventRow.day)
        .where(UsageEventRow.day < today, UsageEventRow.day.not_in(rolled))
        .distinct()
        .order_by(UsageEventRow.day)
    )
    return list(session.scalars(query))


def rollup_pending_days(session_factory: sessionmaker[Session], *, now: datetime | None = None) -> list[date]:
    """The beat task: roll up every closed day that needs it; returns the days done."""
    today = (now or datetime.now(UTC)).astimezone(UTC).date()
    with session_factory() as session:
        days = pending_days(session, today=today)
    for day in days:
        rollup_day(session_factory, day)
    return days


def _lock_rollups(session: Session) -> None:
    """Serialize concurrent rollups (two beat runs) on PostgreSQL; SQLite serializes writers itself."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
