"""The per-request log: one tenant's ledger rows, newest first, with what each request was charged.

Pages are keyset-paginated on (created_at, id), never OFFSET: a page costs the
same at the millionth row as at the first, and rows arriving meanwhile neither
shift nor repeat later pages. The cursor is opaque to clients (base64 of the
last row's position). Totals cover the whole filtered set, not one page, so a
session's cost is one call.
"""

from __future__ import annotations

import base64
import binascii
import csv
import io
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from loraplex.billing.events import UsageStatus
from loraplex.billing.models import UsageEventRow
from loraplex.billing.reports import TOKEN_COLUMNS, format_usd, parse_day_range
from loraplex.engine.errors import InvalidRequestError
from sqlalchemy import Select, and_, func, or_, select
from sqlalchemy.orm import Session

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
BASE_ADAPTER = "base"   # the adapter_id filter value for requests to the base model (no adapter)

REQUEST_COLUMNS = (
    "request_id", "created_at", "api_key_id", "model", "adapter_id", "session_id", "user", "status",
    *TOKEN_COLUMNS, "total_tokens", "cost_usd", "price_id", "ttft_ms", "duration_ms",
)


@dataclass(frozen=True, slots=True)
class RequestLogQuery:
    tenant_id: str                       # always one tenant: the log never spans tenants
    start: date
    end: date                            # inclusive
    api_key_id: str | None = None
    model: str | None = None
    adapter_id: str | None = None        # BASE_ADAPTER: the base model
    session_id: str | None = None
    user: str | None = None              # the end user (OpenAI's `user` field) the requests named
    status: str | None = None
    limit: int = DEFAULT_LIMIT
    after: tuple[datetime, int] | None = None   # the decoded cursor: (created_at, id) of the last row seen

    @classmethod
    def parse(cls, *, tenant_id: str, start: str | None = None, end: str | None = None,
              api_key_id: str | None = None, model: str | None = None, adapter_id: str | None = None,
              session_id: str | None = None, user: str | None = None, status: str | None = None,
              limit: int | str | None = None,
              cursor: str | None = None, today: date | None = None) -> RequestLogQuery:
        """Validate query-string input; raises InvalidRequestError naming the bad parameter."""
        start_day, end_day = parse_day_range(start=start, end=end, today=today)
        if status is not None and status not in UsageStatus.ALL:
            raise InvalidRequestError(f"status must be one of {', '.join(sorted(UsageStatus.ALL))}, not {status!r}",
                                      param="status")
        return cls(tenant_id=tenant_id, start=start_day, end=end_day, api_key_id=api_key_id or None,
                   model=model or None, adapter_id=adapter_id or None, session_id=session_id or None,
                   user=user or None, status=status, limit=_parse_limit(limit), after=decode_cursor(cursor) if cursor else None)


@dataclass(frozen=True, slots=True)
class RequestPage:
    rows: list[dict[str, Any]]
    has_more: bool
    next_cursor: str | None
    totals: dict[str, Any]


def _parse_limit(value: int | str | None) -> int:
    if value is None or value == "":
        return DEFAULT_LIMIT
    try:
        limit = int(value)
    except (TypeError, ValueError):
        raise InvalidRequestError("limit must be an integer", param="limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidRequestError(f"limit must be between 1 and {MAX_LIMIT}", param="limit")
    return limit


def encode_cursor(created_at: datetime, row_id: int) -> str:
    text = f"{_utc(created_at).isoformat()}|{row_id}"
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, int]:
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        moment, _, row_id = text.partition("|")
        created_at = datetime.fromisoformat(moment)
        if created_at.tzinfo is None:
            raise ValueError("naive time")
        if not (row_id.isascii() and row_id.isdigit() and len(row_id) <= 18):  # a BIGINT row id, as encoded
            raise ValueError("row id")
        return created_at.astimezone(UTC), int(row_id)
    except (ValueError, OverflowError, binascii.Error, UnicodeDecodeError):  # OverflowError: 0001-01-01+01:00
        raise InvalidRequestError("cursor is not one this API returned", param="cursor") from None


def list_requests(session: Session, query: RequestLogQuery) -> RequestPage:
    """One page, newest first, plus totals over every row the filters match."""
    e = UsageEventRow
    page = _filtered(select(e), query).order_by(e.created_at.desc(), e.id.desc()).limit(query.limit + 1)
    if query.after is not None:
        at, row_id = query.after
        page = page.where(or_(e.created_at < at, and_(e.created_at == at, e.id < row_id)))
    found = list(session.scalars(page))
    has_more = len(found) > query.limit
    found = found[:query.limit]
    next_cursor = encode_cursor(found[-1].created_at, found[-1].id) if has_more else None
    return RequestPage(rows=[request_row(row) for row in found], has_more=has_more, next_cursor=next_cursor,
                       totals=request_totals(session, query))


def request_totals(session: Session, query: RequestLogQuery) -> dict[str, Any]:
    e = UsageEventRow
    sums = [func.count(), *(func.coalesce(func.sum(getattr(e, name)), 0) for name in TOKEN_COLUMNS),
            func.coalesce(func.sum(e.cost_picousd), 0)]
    requests, *tokens, cost = (int(v) for v in session.execute(_filtered(select(*sums), query)).one())
    totals: dict[str, Any] = {"requests": requests, **dict(zip(TOKEN_COLUMNS, tokens, strict=True))}
    totals["total_tokens"] = totals["input_tokens"] + totals["output_tokens"]
    totals["cost_usd"] = format_usd(cost)
    return totals


def get_request(session: Session, *, tenant_id: str, request_id: str) -> dict[str, Any] | None:
    """The row of one request, or None if absent or another tenant's (the caller cannot tell which)."""
    e = UsageEventRow
    row = session.scalar(select(e).where(e.request_id == request_id, e.tenant_id == tenant_id))
    return None if row is None else request_row(row)


def _filtered(statement: Select, query: RequestLogQuery) -> Select:
    e = UsageEventRow
    # A created_at range rather than `day`: it rides the (tenant_id, created_at, id) index with the ordering.
    since = datetime.combine(query.start, time(), tzinfo=UTC)
    until = datetime.combine(query.end + timedelta(days=1), time(), tzinfo=UTC)
    statement = statement.where(e.tenant_id == query.tenant_id, e.created_at >= since, e.created_at < until)
    for column, value in ((e.api_key_id, query.api_key_id), (e.model, query.model),
                          (e.session_id, query.session_id), (e.end_user, query.user), (e.status, query.status)):
        if value is not None:
            statement = statement.where(column == value)
    if query.adapter_id == BASE_ADAPTER:
        statement = statement.where(e.adapter_id.is_(None))
    elif query.adapter_id is not None:
        statement = statement.where(e.adapter_id == query.adapter_id)
    return statement


def request_row(row: UsageEventRow) -> dict[str, Any]:
    return {
        "request_id": row.request_id,
        "created_at": _utc(row.created_at).isoformat(),
        "api_key_id": row.api_key_id,
        "model": row.model,
        "adapter_id": row.adapter_id,
        "session_id": row.session_id,
        "user": row.end_user,
        "status": row.status,
        "input_tokens": row.input_tokens,
        "cached_input_tokens": row.cached_input_tokens,
        "output_tokens": row.output_tokens,
        "thinking_tokens": row.thinking_tokens,
        "total_tokens": row.input_tokens + row.output_tokens,
        "cost_usd": format_usd(row.cost_picousd),
        "price_id": row.price_id,
        "ttft_ms": row.ttft_ms,
        "duration_ms": row.duration_ms,
    }


def requests_csv(rows: list[dict[str, Any]]) -> str:
    """The page's rows in REQUEST_COLUMNS order; empty cells for missing values, as report_csv writes them."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(REQUEST_COLUMNS)
    for row in rows:
        writer.writerow(["" if row[name] is None else row[name] for name in REQUEST_COLUMNS])
    return buffer.getvalue()


def _utc(moment: datetime) -> datetime:
    # SQLite hands timestamps back naive; the ledger stored them in UTC.
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
