"""Migrations 0003_billing and 0004 build exactly the schema of billing.models, and downgrade cleanly."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from loraplex.billing.models import BillingBase
from loraplex.platform.db import migrate
from sqlalchemy import create_engine, inspect


def test_upgrade_matches_models_and_downgrade_removes_tables(db_url):
    migrate.upgrade(db_url, "head")
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = [d for d in compare_metadata(context, BillingBase.metadata)
                    if _table_of(d) is None or _table_of(d).startswith("billing_")]
        assert diff == []
        migrate.downgrade(db_url, "0002_adapters")
        assert not [t for t in inspect(engine).get_table_names() if t.startswith("billing_")]
    finally:
        engine.dispose()


def test_request_log_indexes_upgrade_and_downgrade(db_url):
    """0004 adds the per-request log's two indexes; stepping back to 0003 drops exactly those."""
    wanted = {"ix_billing_usage_events_tenant_created": ["tenant_id", "created_at", "id"],
              "ix_billing_usage_events_tenant_session": ["tenant_id", "session_id"]}
    migrate.upgrade(db_url, "0004_request_log_indexes")
    engine = create_engine(db_url)
    try:
        assert wanted.items() <= _indexes(engine).items()
        migrate.downgrade(db_url, "0003_billing")
        left = set(_indexes(engine))
        assert not left & set(wanted) and "ix_billing_usage_events_tenant_day" in left
        migrate.upgrade(db_url, "head")
        assert wanted.items() <= _indexes(engine).items()
    finally:
        engine.dispose()


def _indexes(engine) -> dict[str, list[str]]:
    return {ix["name"]: ix["column_names"] for ix in inspect(engine).get_indexes("billing_usage_events")}


def _table_of(diff) -> str | None:
    """The table a diff entry is about (only billing tables are ours to check)."""
    op, *rest = diff[0] if isinstance(diff, list) else diff
    if op.endswith("_table"):
        return rest[0].name
    if op.endswith(("_index", "_constraint")):
        return rest[0].table.name
    if op.endswith("_column") or op.startswith("modify_"):
        return rest[1]
    return None
