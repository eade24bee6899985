"""Usage reports: tokens by class, requests and cost, grouped by day, model, adapter, API key or user.

Closed days that are rolled up are read from the rollups; every other day
(today, and closed days whose rollup is missing or stale) from the raw
events. Both halves are one UNION ALL statement, so a rollup finishing
mid-report can neither double-count nor drop a day. Rollups carry no end
user, so a report grouped by `user` reads raw events only (by the
(tenant_id, end_user, created_at) index for one tenant).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

from loraplex.billing.models import NONE_KEY, DailyUsageRow, RolledUpDayRow, UsageEventRow
from loraplex.billing.pricing import picousd_to_usd
from loraplex.engine.errors import InvalidRequestError
from sqlalchemy import func, literal, select, union_all
from sqlalchemy.orm import Session

GROUP_BY_CHOICES = ("day", "model", "adapter", "api_key", "tenant", "user")
TOKEN_COLUMNS = ("input_tokens", "cached_input_tokens", "output_tokens", "thinking_tokens")
MAX_REPORT_DAYS = 366


@dataclass(frozen=True, slots=True)
class ReportQuery:
    start: date
    end: date                       # inclusive
    group_by: tuple[str, ...] = ("day",)
    tenant_id: str | None = None    # None: every tenant (admins only; the route decides)

    @classmethod
    def parse(cls, *, start: str | None, end: str | None, group_by: str | None, tenant_id: str | None,
              today: date | None = None) -> ReportQuery:
        """Validate query-string input; defaults to the current month, grouped by day."""
        start_day, end_day = parse_day_range(start=start, end=end, today=today)
        keys = tuple(k.strip() for k in (group_by or "day").split(",") if k.strip())
        for key in keys:
            if key not in GROUP_BY_CHOICES:
                raise InvalidRequestError(
                    f"group_by must be among {', '.join(GROUP_BY_CHOICES)} (comma-separated), not {key!r}",
                    param="group_by",
                )
        return cls(start=start_day, end=end_day, group_by=tuple(dict.fromkeys(keys)), tenant_id=tenant_id)


def parse_day_range(*, start: str | None, end: str | None, today: date | None = None) -> tuple[date, date]:
    """(start, end) days from query-string input, inclusive; defaults to the current month so far (UTC)."""
    today = today or datetime.now(UTC).date()
    start_day = _parse_day(start, "start") if start else today.replace(day=1)
    end_day = _parse_day(end, "end") if end else today
    if end_day < start_day:
        raise InvalidRequestError("end must not be before start", param="end")
    if end_day >= date.max:  # the day after `end` bounds the queries: it must be a date too
        raise InvalidRequestError(f"end must be before {date.max.isoformat()}", param="end")
    if (end_day - start_day).days >= MAX_REPORT_DAYS:
        raise InvalidRequestError(f"a report covers at most {MAX_REPORT_DAYS} days", param="start")
    return start_day, end_day


def format_usd(picousd: int) -> str:
    """An exact decimal string ("0.00042"), never a float: what CSV and per-request costs show."""
    return format(picousd_to_usd(picousd).normalize(), "f")


def _parse_day(value: str, param: str) -> date:
    try:
        return date.fromisoformat(value[:10])
    except ValueError:
        raise InvalidRequestError(f"{param} must be a date like 2026-11-26", param=param) from None


def usage_report(session: Session, query: ReportQuery, *, today: date | None = None,
                 max_rows: int | None = None) -> list[dict[str, Any]]:
    """One row per group, ordered by the group keys; empty groups are absent. More than `max_rows` groups (one
    per end user a day, say: `user` is any string a request sends) is a 400 asking for a narrower report."""
    today = today or datetime.now(UTC).date()
    rolled_days = select(RolledUpDayRow.day).where(RolledUpDayRow.day < today)

    by_user = "user" in query.group_by
    d = DailyUsageRow
    from_rollups = select(
        d.day, d.tenant_id, d.model, d.adapter_id, d.api_key_id, literal(NONE_KEY),
        d.input_tokens, d.cached_input_tokens, d.output_tokens, d.thinking_tokens,
        d.requests, d.cost_picousd,
    ).where(d.day.between(query.start, query.end), d.day.in_(rolled_days))
    e = UsageEventRow
    from_events = select(
        e.day, e.tenant_id, e.model, func.coalesce(e.adapter_id, NONE_KEY), func.coalesce(e.api_key_id, NONE_KEY),
        func.coalesce(e.end_user, NONE_KEY), e.input_tokens, e.cached_input_tokens, e.output_tokens,
        e.thinking_tokens, literal(1), e.cost_picousd,
    ).where(e.day.between(query.start, query.end))
    if not by_user:
        from_events = from_events.where(e.day.not_in(rolled_days))
    if query.tenant_id is not None:
        from_rollups = from_rollups.where(d.tenant_id == query.tenant_id)
        from_events = from_events.where(e.tenant_id == query.tenant_id)

    both = (from_events if by_user else union_all(from_rollups, from_events)).subquery("usage")
    names = ["day", "tenant_id", "model", "adapter_id", "api_key_id", "end_user", *TOKEN_COLUMNS, "requests",
             "cost_picousd"]
    columns = dict(zip(names, both.c, strict=True))
    group_columns = [columns[_GROUP_COLUMN[key]] for key in query.group_by]
    sums = [func.sum(columns[name]) for name in (*TOKEN_COLUMNS, "requests", "cost_picousd")]
    statement = select(*group_columns, *sums).group_by(*group_columns).order_by(*group_columns)
    if max_rows is not None:
        statement = statement.limit(max_rows + 1)

    rows = []
    for record in session.execute(statement):
        values = list(record)
        row: dict[str, Any] = {}
        for key, value in zip(query.group_by, values, strict=False):
            row[key] = _group_value(key, value)
        totals = [int(v or 0) for v in values[len(query.group_by):]]
        row.update(_metrics(*totals))
        rows.append(row)
    if max_rows is not None and len(rows) > max_rows:
        raise InvalidRequestError(f"the report has more than {max_rows} rows (usage_report_max_rows); narrow "
                                  "start and end, or group by fewer keys", param="group_by")
    return rows


_GROUP_COLUMN = {"day": "day", "model": "model", "adapter": "adapter_id", "api_key": "api_key_id", "tenant": "tenant_id",
                 "user": "end_user"}


def _group_value(key: str, value: Any) -> Any:
    if key == "day":
        return value.isoformat() if isinstance(value, date) else str(value)
    if key in ("adapter", "api_key", "user") and value == NONE_KEY:
        return None
    return value


def _metrics(input_tokens: int, cached: int, output: int, thinking: int, requests: int, cost: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "cached_input_tokens": cached,
        "output_tokens": output,
        "thinking_tokens": thinking,
        "total_tokens": input_tokens + output,
        "requests": requests,
        "cost_picousd": cost,
        "cost_usd": float(picousd_to_usd(cost)),
    }


def report_totals(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    sums = [sum(row[name] for row in rows) for name in (*TOKEN_COLUMNS, "requests", "cost_picousd")]
    return _metrics(*sums)


def report_json(query: ReportQuery, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "object": "usage.report",
        "tenant_id": query.tenant_id,
        "start": query.start.isoformat(),
        "end": query.end.isoformat(),
        "group_by": list(query.group_by),
        "data": rows,
        "totals": report_totals(rows),
    }


def report_csv(query: ReportQuery, rows: list[dict[str, Any]]) -> str:
    """Group columns first, then the metrics; cost as an exact decimal string."""
    header = [*query.group_by, *TOKEN_COLUMNS, "total_tokens", "requests", "cost_usd"]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        cost = format_usd(row["cost_picousd"])
        writer.writerow([*("" if row[k] is None else row[k] for k in query.group_by),
                         *(row[name] for name in (*TOKEN_COLUMNS, "total_tokens", "requests")), cost])
    return buffer.getvalue()
