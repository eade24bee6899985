"""`loraplex db ...`: schema migrations."""

from __future__ import annotations

import typer
from loraplex.platform.cli.common import console, load_settings
from loraplex.platform.db import migrate
from loraplex.platform.db.session import make_db_engine

app = typer.Typer(help="Database schema migrations (Alembic; every domain's tables).", no_args_is_help=True)


@app.command()
def upgrade(revision: str = typer.Argument("head", help="Target revision (default: the newest).")) -> None:
    """Apply migrations up to REVISION on LORAPLEX_DATABASE_URL."""
    settings = load_settings()
    migrate.upgrade(settings.resolved_database_url, revision)
    console.print(f"database at revision [bold]{_current(settings.resolved_database_url)}[/bold]")


@app.command()
def downgrade(
    revision: str = typer.Argument(..., help="Target revision, e.g. 0001_platform, -1, or base (drops everything)."),
    yes: bool = typer.Option(False, "--yes", help="Do not ask for confirmation."),
) -> None:
    """Revert migrations down to REVISION (data in dropped tables is lost)."""
    settings = load_settings()
    if not yes:
        typer.confirm(f"Downgrade {settings.resolved_database_url} to {revision}?", abort=True)
    migrate.downgrade(settings.resolved_database_url, revision)
    console.print(f"database at revision [bold]{_current(settings.resolved_database_url) or 'base'}[/bold]")


@app.command()
def current() -> None:
    """Print the database's current revision and the newest one available."""
    settings = load_settings()
    url = settings.resolved_database_url
    console.print(f"current: {_current(url) or 'base (empty)'}\nhead:    {migrate.head_revision(url)}")


def _current(url: str) -> str | None:
    engine = make_db_engine(url)
    try:
        return migrate.current_revision(engine)
    finally:
        engine.dispose()
