"""`loraplex prices ...` and `loraplex budgets ...` against a migrated PostgreSQL database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from loraplex.billing.ledger import Ledger
from loraplex.billing.models import BudgetRow, PriceRow
from loraplex.billing.pricing import PriceBook
from loraplex.platform.auth import store
from loraplex.platform.auth.scopes import Scope
from loraplex.platform.cli.main import app
from loraplex.platform.db import migrate
from loraplex.platform.db.session import make_db_engine, make_session_factory
from sqlalchemy import select
from typer.testing import CliRunner


@pytest.fixture
def pg_cli(pg_url, tmp_path, monkeypatch):
    """A CLI configured for a fresh PostgreSQL database with tenants acme (one key) and globex (one key)."""
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", pg_url)
    migrate.upgrade(pg_url)
    engine = make_db_engine(pg_url)
    factory = make_session_factory(engine)
    with factory() as db:
        acme = store.create_tenant(db, name="acme")
        globex = store.create_tenant(db, name="globex")
        keys = {
            "acme": store.create_api_key(db, tenant=acme, scopes=[Scope.INFERENCE]).record.id,
            "globex": store.create_api_key(db, tenant=globex, scopes=[Scope.INFERENCE]).record.id,
        }
    yield CliRunner(), factory, {"acme": acme.id, "globex": globex.id}, keys
    engine.dispose()


def run(runner: CliRunner, *args: str, code: int = 0) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == code, result.output
    return result.output


def test_prices_add_and_list(pg_cli):
    runner, factory, _tenants, _keys = pg_cli
    assert "added price" in run(runner, "prices", "add", "--model", "smollm2", "--input", "0.15", "--output", "0.6",
                                "--cached-input", "0.075")
    later = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    run(runner, "prices", "add", "--model", "smollm2", "--input", "0.2", "--output", "0.8", "--effective-from", later)
    run(runner, "prices", "add", "--model", "*", "--input", "1", "--output", "2")
    with factory() as db:
        first = db.scalar(select(PriceRow).where(PriceRow.input_micro_usd_per_mtok == 150_000))
    assert (first.cached_input_micro_usd_per_mtok, first.output_micro_usd_per_mtok,
            first.thinking_micro_usd_per_mtok) == (75_000, 600_000, 600_000)

    lines = [line.split("\t") for line in run(runner, "prices", "list", "--model", "smollm2").splitlines()]
    assert lines[0][:4] == ["id", "model", "adapter", "input"]
    assert [(row[3], row[4], row[-1]) for row in lines[1:]] == [("0.2", "0.2", ""), ("0.15", "0.075", "yes")]
    assert len(run(runner, "prices", "list").splitlines()) == 4
    assert "no adapter" in run(runner, "prices", "add", "--model", "m", "--adapter", "adp_x", "--input", "1",
                               "--output", "1", code=1)


@pytest.mark.parametrize(("args", "message"), [
    (["--input", "-1", "--output", "1"], "must not be negative"),
    (["--input", "0.0000001", "--output", "1"], "decimal places"),
    (["--input", "abc", "--output", "1"], "number of USD"),
    (["--input", "1", "--output", "1", "--effective-from", "2020-01-01T00:00:00Z"], "in the past"),
    (["--input", "1", "--output", "1", "--effective-from", "next tuesday"], "ISO date-time"),
])
def test_bad_prices_exit_non_zero_and_write_nothing(pg_cli, args, message):
    runner, factory, _tenants, _keys = pg_cli
    output = run(runner, "prices", "add", "--model", "smollm2", *args, code=2)
    assert message in " ".join(output.split())  # rich may wrap long lines
    with factory() as db:
        assert db.scalars(select(PriceRow)).all() == []


def test_budgets_set_list_clear(pg_cli, make_event):
    runner, factory, tenants, keys = pg_cli
    run(runner, "prices", "add", "--model", "smollm2", "--input", "1", "--output", "2")
    assert "no budgets" in run(runner, "budgets", "list", "--tenant", "acme")
    run(runner, "budgets", "set", "--tenant", "acme", "--tokens", "1000")
    run(runner, "budgets", "set", "--tenant", tenants["acme"], "--key", keys["acme"], "--cost", "0.5")
    with factory() as db:
        rows = {row.api_key_id: row for row in db.scalars(select(BudgetRow))}
    assert rows[""].monthly_token_limit == 1000 and rows[keys["acme"]].monthly_cost_limit_picousd == 5 * 10**11

    Ledger(factory, PriceBook(factory)).write(
        [make_event(f"e{i}", tenant_id=tenants["acme"], api_key_id=keys["acme"]) for i in range(2)])
    lines = [line.split("\t") for line in run(runner, "budgets", "list", "--tenant", "acme").splitlines()]
    by_scope = {line[0]: line for line in lines[1:]}
    # two events of 100 input + 50 output tokens at $1 / $2 per million: $0.0002 each
    assert by_scope["tenant"][1:4] == ["1000", "300", "700"]
    assert by_scope[keys["acme"]][4:7] == ["0.5", "0.0004", "0.4996"]

    assert "no API key" in run(runner, "budgets", "set", "--tenant", "acme", "--key", keys["globex"],
                               "--tokens", "5", code=1)
    assert "no tenant" in run(runner, "budgets", "set", "--tenant", "nobody", "--tokens", "5", code=1)
    assert "must not be negative" in run(runner, "budgets", "set", "--tenant", "acme", "--tokens", "-5", code=2)
    assert "--tokens" in run(runner, "budgets", "set", "--tenant", "acme", code=2)

    assert "cleared" in run(runner, "budgets", "clear", "--tenant", "acme", "--key", keys["acme"])
    assert "no budget" in run(runner, "budgets", "clear", "--tenant", "acme", "--key", keys["acme"], code=1)
    run(runner, "budgets", "clear", "--tenant", "acme")
    with factory() as db:
        assert db.scalars(select(BudgetRow)).all() == []
