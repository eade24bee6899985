"""Rollups equal raw events; reports read rollups for closed days and raw events otherwise."""

from __future__ import annotations

import csv
import io
import random
from datetime import UTC, date, datetime, timedelta

import pytest
from loraplex.billing.ledger import Ledger
from loraplex.billing.models import DailyUsageRow, UsageEventRow
from loraplex.billing.pricing import add_price
from loraplex.billing.reports import ReportQuery, report_csv, report_json, usage_report
from loraplex.billing.rollups import pending_days, rollup_day, rollup_pending_days
from loraplex.engine.errors import InvalidRequestError
from sqlalchemy import func, select

# One instant for the whole module: its fixtures date events from it, so a run that crosses midnight UTC
# must not let the code under test read a later clock.
NOW = datetime.now(UTC)
TODAY = NOW.date()
DAYS = [TODAY - timedelta(days=k) for k in (3, 2, 1, 0)]


@pytest.fixture
def ledger_with_mix(session_factory, make_event):
    """~400 events over four days, two tenants, two models, adapters, keys, statuses."""
    with session_factory() as session, session.begin():
        add_price(session, model="*", input_usd_per_mtok="0.1", cached_input_usd_per_mtok="0.05",
                  output_usd_per_mtok="0.4", thinking_usd_per_mtok="0.8",
                  effective_from=datetime(2020, 1, 1, tzinfo=UTC))
    rng = random.Random(7)
    events = []
    for i in range(400):
        day = rng.choice(DAYS)
        inputs = rng.randint(1, 500)
        outputs = rng.randint(0, 200)
        events.append(make_event(
            f"r{i}",
            tenant_id=rng.choice(["ten_a", "ten_a", "ten_b"]),
            model=rng.choice(["smollm2", "llama"]),
            adapter_id=rng.choice([None, "ad_1", "ad_2"]),
            api_key_id=rng.choice([None, "key_1", "key_2"]),
            created_at=datetime.combine(day, datetime.min.time(), UTC) + timedelta(seconds=rng.randint(0, 86399)),
            input_tokens=inputs, cached_input_tokens=rng.randint(0, inputs),
            output_tokens=outputs, thinking_tokens=rng.randint(0, outputs),
        ))
    Ledger(session_factory).write(events)
    return events


def _raw(session_factory, tenant_id: str, key_of) -> dict:
    """The same report computed directly from raw events in Python."""
    with session_factory() as session:
        rows = session.scalars(select(UsageEventRow).where(UsageEventRow.tenant_id == tenant_id)).all()
    out: dict = {}
    for row in rows:
        totals = out.setdefault(key_of(row), [0, 0, 0, 0, 0, 0])
        for index, value in enumerate((row.input_tokens, row.cached_input_tokens, row.output_tokens,
                                       row.thinking_tokens, 1, row.cost_picousd)):
            totals[index] += value
    return out


def _as_dict(rows, keys) -> dict:
    return {
        tuple(row[k] for k in keys) if len(keys) > 1 else row[keys[0]]: [
            row["input_tokens"], row["cached_input_tokens"], row["output_tokens"], row["thinking_tokens"],
            row["requests"], row["cost_picousd"],
        ]
        for row in rows
    }


def test_rollups_match_raw_events_and_recompute_idempotently(session_factory, ledger_with_mix):
    with session_factory() as session:
        assert pending_days(session, today=TODAY) == DAYS[:3]
    assert rollup_pending_days(session_factory, now=NOW) == DAYS[:3]
    assert rollup_pending_days(session_factory, now=NOW) == [], "nothing pending twice"
    rollup_day(session_factory, DAYS[0])  # recompute: same rows, not doubled
    e, d = UsageEventRow, DailyUsageRow
    sums = [func.sum(c) for c in (e.input_tokens, e.cached_input_tokens, e.output_tokens, e.thinking_tokens,
                                   e.cost_picousd)]
    with session_factory() as session:
        raw = session.execute(select(e.day, func.count(), *sums).where(e.day < TODAY).group_by(e.day)
                              .order_by(e.day)).all()
        rolled = session.execute(
            select(d.day, func.sum(d.requests), *[func.sum(c) for c in (
                d.input_tokens, d.cached_input_tokens, d.output_tokens, d.thinking_tokens, d.cost_picousd)])
            .group_by(d.day).order_by(d.day)).all()
    assert [tuple(r) for r in raw] == [tuple(r) for r in rolled]
    assert len(raw) == 3


@pytest.mark.parametrize("group_by", ["day", "model", "adapter", "api_key", "day,model"])
def test_report_groups_match_the_ledger(session_factory, ledger_with_mix, group_by):
    rollup_pending_days(session_factory, now=NOW)  # closed days from rollups, today from raw events
    key_funcs = {
        "day": lambda r: r.day.isoformat(), "model": lambda r: r.model,
        "adapter": lambda r: r.adapter_id, "api_key": lambda r: r.api_key_id,
    }
    keys = group_by.split(",")
    query = ReportQuery.parse(start=DAYS[0].isoformat(), end=TODAY.isoformat(), group_by=group_by,
                              tenant_id="ten_a", today=TODAY)
    with session_factory() as session:
        rows = usage_report(session, query, today=TODAY)
    expected = _raw(session_factory, "ten_a",
                    lambda r: tuple(key_funcs[k](r) for k in keys) if len(keys) > 1 else key_funcs[keys[0]](r))
    assert _as_dict(rows, keys) == expected


def test_report_reads_late_events_of_a_rolled_up_day(session_factory, ledger_with_mix, make_event):
    rollup_pending_days(session_factory, now=NOW)
    Ledger(session_factory).write([make_event("late", tenant_id="ten_a", created_at=datetime.combine(
        DAYS[1], datetime.min.time(), UTC), input_tokens=1000, cached_input_tokens=0)])
    query = ReportQuery(start=DAYS[0], end=TODAY, group_by=("day",), tenant_id="ten_a")
    with session_factory() as session:
        rows = usage_report(session, query, today=TODAY)
    assert _as_dict(rows, ["day"]) == _raw(session_factory, "ten_a", lambda r: r.day.isoformat())


def test_tenant_sees_only_its_own_usage(session_factory, ledger_with_mix):
    with session_factory() as session:
        a = usage_report(session, ReportQuery(start=DAYS[0], end=TODAY, group_by=("day",), tenant_id="ten_a"), today=TODAY)
        b = usage_report(session, ReportQuery(start=DAYS[0], end=TODAY, group_by=("day",), tenant_id="ten_b"), today=TODAY)
        everyone = usage_report(session, ReportQuery(start=DAYS[0], end=TODAY, group_by=("tenant",)), today=TODAY)
        nobody = usage_report(session, ReportQuery(start=DAYS[0], end=TODAY, tenant_id="ten_zzz"), today=TODAY)
    requests = {row["tenant"]: row["requests"] for row in everyone}
    assert sum(r["requests"] for r in a) == requests["ten_a"]
    assert sum(r["requests"] for r in b) == requests["ten_b"]
    assert requests["ten_a"] + requests["ten_b"] == 400
    assert nobody == []


def test_report_range_excludes_days_outside(session_factory, ledger_with_mix):
    with session_factory() as session:
        rows = usage_report(session, ReportQuery(start=DAYS[1], end=DAYS[2], group_by=("day",), tenant_id="ten_a"), today=TODAY)
    assert [row["day"] for row in rows] == [DAYS[1].isoformat(), DAYS[2].isoformat()]


def test_a_report_past_its_row_limit_is_a_400_naming_group_by(session_factory, ledger_with_mix):
    query = ReportQuery(start=DAYS[0], end=TODAY, group_by=("day",), tenant_id="ten_a")
    with session_factory() as session:
        days = usage_report(session, query, today=TODAY)
        assert usage_report(session, query, today=TODAY, max_rows=len(days)) == days
        with pytest.raises(InvalidRequestError, match="more than 1 rows") as refused:
            usage_report(session, query, today=TODAY, max_rows=1)
    assert len(days) > 1 and refused.value.param == "group_by"


def test_json_and_csv_carry_the_same_figures(session_factory, ledger_with_mix):
    rollup_pending_days(session_factory, now=NOW)
    query = ReportQuery(start=DAYS[0], end=TODAY, group_by=("model", "adapter"), tenant_id="ten_a")
    with session_factory() as session:
        rows = usage_report(session, query, today=TODAY)
    body = report_json(query, rows)
    parsed = list(csv.DictReader(io.StringIO(report_csv(query, rows))))
    assert len(parsed) == len(body["data"])
    for line, row in zip(parsed, body["data"], strict=True):
        assert line["model"] == row["model"]
        assert (line["adapter"] or None) == row["adapter"]
        for name in ("input_tokens", "cached_input_tokens", "output_tokens", "thinking_tokens", "requests"):
            assert int(line[name]) == row[name]
        assert round(float(line["cost_usd"]) * 1e12) == row["cost_picousd"]
    assert body["totals"]["requests"] == sum(row["requests"] for row in rows)


@pytest.mark.parametrize(
    ("start", "end", "group_by", "param"),
    [("2026-13-01", None, None, "start"), ("2026-11-10", "2026-11-01", None, "end"),
     ("2020-01-01", "2026-01-01", None, "start"), (None, None, "color", "group_by")],
)
def test_bad_report_query_is_a_typed_error(start, end, group_by, param):
    with pytest.raises(InvalidRequestError) as raised:
        ReportQuery.parse(start=start, end=end, group_by=group_by, tenant_id="t", today=date(2026, 11, 26))
    assert raised.value.param == param
