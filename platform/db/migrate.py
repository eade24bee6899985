"""Run the Alembic chain programmatically (the CLI and the server's start-up call these)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from loraplex.platform.db.session import make_db_engine
from sqlalchemy import Engine

if TYPE_CHECKING:
    from loraplex.platform.settings import Settings


def migrations_dir() -> Path:
    """The repository's `migrations/` folder (next to `platform/` in a checkout or editable install)."""
    candidates = [Path(__file__).resolve().parents[2] / "migrations", Path.cwd() / "migrations"]
    for candidate in candidates:
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError("migrations/ not found; run from a loraplex checkout")


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    # ConfigParser interpolation would eat a '%' in a password.
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision(database_url: str) -> str | None:
    return ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()


def is_up_to_date(database_url: str) -> bool:
    engine = make_db_engine(database_url)
    try:
        return current_revision(engine) == head_revision(database_url)
    finally:
        engine.dispose()


def prepare_database(settings: Settings) -> None:
    """The SQLite default migrates itself; PostgreSQL is migrated explicitly (`loraplex db upgrade`)."""
    if settings.is_sqlite and settings.migrate_on_start:
        upgrade(settings.resolved_database_url)
