"""The Alembic chain upgrades and downgrades cleanly on SQLite and PostgreSQL, and matches the models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from loraplex.platform.db import migrate
from loraplex.platform.db.metadata import domain_metadatas
from loraplex.platform.db.session import make_db_engine
from sqlalchemy import inspect


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path, new_postgres_database: Any) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'migrations.db'}"
        return
    with new_postgres_database("loraplex_migrations") as url:
        yield url


def _tables(url: str) -> set[str]:
    engine = make_db_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(database_url: str) -> None:
    migrate.upgrade(database_url)
    tables = _tables(database_url)
    assert {"tenants", "api_keys", "alembic_version"} <= tables
    assert migrate.is_up_to_date(database_url)

    migrate.downgrade(database_url, "base")
    assert _tables(database_url) <= {"alembic_version"}

    migrate.upgrade(database_url)
    assert _tables(database_url) == tables


def test_each_revision_steps_down_and_up(database_url: str) -> None:
    migrate.upgrade(database_url)
    head = migrate.head_revision(database_url)
    steps = 0
    engine = make_db_engine(database_url)
    try:
        while migrate.current_revision(engine) is not None:
            migrate.downgrade(database_url, "-1")
            steps += 1
        for _ in range(steps):
            migrate.upgrade(database_url, "+1")
        assert migrate.current_revision(engine) == head
    finally:
        engine.dispose()
    assert steps >= 1


def test_models_match_the_migrations(database_url: str) -> None:
    """Autogenerate finds nothing to do: every domain's tables are exactly what its revision creates."""
    migrate.upgrade(database_url)
    engine = make_db_engine(database_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            differences = [d for metadata in domain_metadatas() for d in compare_metadata(context, metadata)
                           if not _is_other_domains_table(d, metadata)]
    finally:
        engine.dispose()
    assert differences == []


def _is_other_domains_table(diff: object, metadata: object) -> bool:
    """compare_metadata against one domain's metadata reports the other domains' tables as removed."""
    if isinstance(diff, tuple) and diff and diff[0] == "remove_table":
        return diff[1].name not in metadata.tables or diff[1].name == "alembic_version"  # type: ignore[attr-defined]
    if isinstance(diff, tuple) and diff and diff[0] == "remove_index":
        return diff[1].table.name not in metadata.tables  # type: ignore[attr-defined]
    return False
