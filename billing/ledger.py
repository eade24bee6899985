"""The ledger: usage events written once, keyed by request id.

A write is `INSERT ... ON CONFLICT (request_id) DO NOTHING RETURNING
request_id`, so replaying a batch (after a crash, from the spool, from two
drainers at once) inserts nothing twice, and the caller learns which events
were new (quota spending counts only those). Each event is priced here, at the
price in force at its `created_at`, inside the same transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import Any

from loraplex.billing.events import UsageEvent
from loraplex.billing.models import RolledUpDayRow, UsageEventRow
from loraplex.billing.pricing import Price, PriceBook, select_price
from loraplex.billing.unavailable import UNAVAILABLE_ERRORS
from sqlalchemy import delete, exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

# Errors that mean "the database cannot be reached right now": spool and retry later.


class LedgerUnavailableError(Exception):
    """The database could not be reached; the events were not written."""


@dataclass(slots=True)
class WriteResult:
    inserted: list[UsageEvent] = field(default_factory=list)
    cost_picousd: dict[str, int] = field(default_factory=dict)  # request id -> cost, for the inserted ones
    duplicates: list[UsageEvent] = field(default_factory=list)
    rejected: list[tuple[UsageEvent, str]] = field(default_factory=list)  # the database refused the row itself


def utc_day(moment: datetime) -> date:
    return moment.astimezone(UTC).date()


class Ledger:
    def __init__(self, session_factory: sessionmaker[Session], price_book: PriceBook | None = None) -> None:
        self._session_factory = session_factory
        self.price_book = price_book or PriceBook(session_factory)

    def write(self, events: Sequence[UsageEvent]) -> WriteResult:
        """Insert the events not yet in the ledger; raise LedgerUnavailableError if the DB is down."""
        unique = list({event.request_id: event for event in events}.values())
        if not unique:
            return WriteResult()
        try:
            return self._write(unique)
        except UNAVAILABLE_ERRORS as error:
            raise LedgerUnavailableError(str(error.orig if hasattr(error, "orig") else error)) from error
        except exc.DBAPIError:
            if len(unique) == 1:
                raise
            return self._write_one_by_one(unique)

    def _write_one_by_one(self, events: list[UsageEvent]) -> WriteResult:
        """One bad row must not block a batch: write singly and set the refused ones aside."""
        result = WriteResult()
        for event in events:
            try:
                single = self._write([event])
            except UNAVAILABLE_ERRORS as error:
                raise LedgerUnavailableError(str(error)) from error
            except exc.DBAPIError as error:
                result.rejected.append((event, str(error.orig)))
                continue
            result.inserted += single.inserted
            result.cost_picousd.update(single.cost_picousd)
            result.duplicates += single.duplicates
        return result

    def _write(self, events: list[UsageEvent]) -> WriteResult:
        now = datetime.now(UTC)
        with self._session_factory() as session, session.begin():
            prices = self.price_book.load(session)
            rows = [self._row(event, prices, now) for event in events]
            statement = _insert_ignoring_duplicates(session).returning(UsageEventRow.request_id)
            inserted_ids = set(session.scalars(statement, rows))
            inserted = [event for event in events if event.request_id in inserted_ids]
            late_days = {utc_day(event.created_at) for event in inserted} - {now.date()}
            if late_days:
                # A closed day got a late event (e.g. drained from the spool): its rollup is stale
                # until recomputed, and reports read its raw events meanwhile.
                session.execute(delete(RolledUpDayRow).where(RolledUpDayRow.day.in_(late_days)))
        duplicates = [event for event in events if event.request_id not in inserted_ids]
        costs = {row["request_id"]: row["cost_picousd"] for row in rows if row["request_id"] in inserted_ids}
        return WriteResult(inserted=inserted, cost_picousd=costs, duplicates=duplicates)

    def _row(self, event: UsageEvent, prices: list[Price], now: datetime) -> dict[str, Any]:
        price = select_price(prices, model=event.model, adapter_id=event.adapter_id, at=event.created_at)
        created_at = event.created_at.astimezone(UTC)
        return {
            "request_id": event.request_id,
            "tenant_id": event.tenant_id,
            "api_key_id": event.api_key_id,
            "model": event.model,
            "adapter_id": event.adapter_id,
            "session_id": event.session_id,
            "end_user": event.user,
            "input_tokens": event.input_tokens,
            "cached_input_tokens": event.cached_input_tokens,
            "output_tokens": event.output_tokens,
            "thinking_tokens": event.thinking_tokens,
            "status": event.status,
            "ttft_ms": event.ttft_ms,
            "duration_ms": event.duration_ms,
            "cost_picousd": self.price_book.cost_picousd(price, event) if price else 0,
            "price_id": price.id if price else None,
            "created_at": created_at,
            "day": created_at.date(),
            "recorded_at": now,
        }


def _insert_ignoring_duplicates(session: Session) -> Any:
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        return postgresql.insert(UsageEventRow).on_conflict_do_nothing(index_elements=["request_id"])
    if dialect == "sqlite":
        return sqlite.insert(UsageEventRow).on_conflict_do_nothing(index_elements=["request_id"])
    raise ValueError(f"the ledger supports PostgreSQL and SQLite, not {dialect}")
