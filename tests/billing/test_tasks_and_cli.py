"""The beat task (rollups + quota reconciliation), `loraplex usage report` and `usage requests`, on real databases
and Redis."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta

import pytest
from loraplex.billing.ledger import Ledger
from loraplex.billing.models import RolledUpDayRow
from loraplex.billing.quotas import QuotaGuard, RedisSpendCounter
from loraplex.billing.tasks import rollup_and_reconcile
from loraplex.platform.auth import store
from loraplex.platform.celery_app import make_celery
from loraplex.platform.cli.main import app
from loraplex.platform.db import migrate
from loraplex.platform.settings import Settings
from typer.testing import CliRunner

NOW = datetime.now(UTC)
YESTERDAY = NOW - timedelta(days=1)


def test_beat_task_rolls_up_closed_days_and_reconciles_quota_counters(
    db_url, session_factory, make_event, redis_url, redis_client, key_prefix
):
    Ledger(session_factory).write([make_event(f"y{i}", created_at=YESTERDAY) for i in range(3)]
                                  + [make_event("today", created_at=NOW)])
    result = rollup_and_reconcile(db_url, redis_url, key_prefix, now=NOW.isoformat())
    assert result["rolled_up_days"] == [YESTERDAY.date().isoformat()]
    assert result["reconciled_counters"] >= 2
    with session_factory() as session:
        assert session.get(RolledUpDayRow, YESTERDAY.date()).num_events == 3
    spend = QuotaGuard(session_factory, RedisSpendCounter(redis_client, key_prefix)).spend(tenant_id="ten_a")
    if YESTERDAY.month == NOW.month:
        assert spend.tokens == 4 * 150
    again = rollup_and_reconcile(db_url, None, key_prefix, now=NOW.isoformat())
    assert again == {"rolled_up_days": [], "reconciled_counters": 0}


def test_celery_beat_schedules_the_billing_task(tmp_path):
    celery = make_celery(Settings(data_dir=tmp_path))
    entry = celery.conf.beat_schedule["billing-rollups"]
    assert entry["task"] in celery.tasks
    assert entry["kwargs"]["database_url"].startswith("sqlite:///")


@pytest.fixture
def cli_db(tmp_path, monkeypatch, make_event):
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("LORAPLEX_DATABASE_URL", raising=False)
    settings = Settings(data_dir=tmp_path)
    migrate.upgrade(settings.resolved_database_url)
    from loraplex.platform.db.session import make_db_engine, make_session_factory

    engine = make_db_engine(settings.resolved_database_url)
    factory = make_session_factory(engine)
    with factory() as db:
        tenant = store.create_tenant(db, name="acme").id
    Ledger(factory).write([make_event(f"c{i}", tenant_id=tenant, created_at=YESTERDAY) for i in range(2)]
                          + [make_event("other", tenant_id="ten_other", created_at=YESTERDAY)])
    yield tenant
    engine.dispose()


def test_usage_report_cli_table_and_csv(cli_db):
    runner = CliRunner()
    day = YESTERDAY.date().isoformat()
    table = runner.invoke(app, ["usage", "report", "--tenant", "acme", "--from", day, "--to", day])
    assert table.exit_code == 0, table.output
    assert day in table.output and "total" in table.output
    as_csv = runner.invoke(app, ["usage", "report", "--tenant", cli_db, "--from", day, "--to", day, "--csv",
                                 "--group-by", "model"])
    assert as_csv.exit_code == 0, as_csv.output
    rows = list(csv.DictReader(io.StringIO(as_csv.output)))
    assert rows == [{"model": "smollm2", "input_tokens": "200", "cached_input_tokens": "40", "output_tokens": "100",
                     "thinking_tokens": "20", "total_tokens": "300", "requests": "2", "cost_usd": "0"}]
    unknown = runner.invoke(app, ["usage", "report", "--tenant", "nobody"])
    assert unknown.exit_code == 1 and "no tenant" in unknown.output
    bad = runner.invoke(app, ["usage", "report", "--tenant", "acme", "--from", "yesterday"])
    assert bad.exit_code == 2 and "start must be a date" in bad.output


def test_usage_requests_cli_pages_filters_and_csv(cli_db, tmp_path, make_event):
    from loraplex.platform.db.session import make_db_engine, make_session_factory

    engine = make_db_engine(Settings(data_dir=tmp_path).resolved_database_url)
    Ledger(make_session_factory(engine)).write(
        [make_event(f"s{i}", tenant_id=cli_db, session_id="ses_1", created_at=NOW - timedelta(minutes=i))
         for i in range(3)])
    engine.dispose()
    runner = CliRunner()
    since = YESTERDAY.date().isoformat()
    table = runner.invoke(app, ["usage", "requests", "--tenant", "acme", "--from", since, "--limit", "2"])
    assert table.exit_code == 0, table.output
    lines = [line.split("\t") for line in table.stdout.splitlines()]
    assert lines[0][:2] == ["created_at", "request_id"]
    assert [line[1] for line in lines[1:-1]] == ["s0", "s1"]  # newest first, two of five
    assert lines[-1][0] == "total (5 requests)" and lines[-1][7] == "500"  # totals: the whole range, not the page
    cursor = table.stderr.split("--cursor")[1].split()[0]
    rest = runner.invoke(app, ["usage", "requests", "--tenant", "acme", "--from", since, "--cursor", cursor])
    # c0 and c1 share one created_at: the later-written row (higher id) comes first
    assert [line.split("\t")[1] for line in rest.stdout.splitlines()[1:-1]] == ["s2", "c1", "c0"]

    as_csv = runner.invoke(app, ["usage", "requests", "--tenant", cli_db, "--session", "ses_1", "--csv"])
    assert as_csv.exit_code == 0, as_csv.output
    rows = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert [row["request_id"] for row in rows] == ["s0", "s1", "s2"]
    assert {row["session_id"] for row in rows} == {"ses_1"} and rows[0]["cost_usd"] == "0"
    bad = runner.invoke(app, ["usage", "requests", "--tenant", "acme", "--limit", "5000"])
    assert bad.exit_code == 2 and "limit must be between" in bad.output
    assert runner.invoke(app, ["usage", "requests", "--tenant", "nobody"]).exit_code == 1
