"""What every CLI command shares: settings, a migrated database session, printing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from loraplex.engine.errors import InvalidRequestError
from loraplex.platform.auth import store
from loraplex.platform.db.migrate import prepare_database
from loraplex.platform.db.models import Tenant
from loraplex.platform.db.session import make_db_engine, make_session_factory
from loraplex.platform.settings import Settings
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from sqlalchemy.orm import Session

console = Console()
err_console = Console(stderr=True)


def load_settings() -> Settings:
    return Settings()


@contextmanager
def db_session(settings: Settings) -> Iterator[Session]:
    """A session on the configured database, migrating the SQLite default first."""
    prepare_database(settings)
    engine = make_db_engine(settings.resolved_database_url)
    try:
        with make_session_factory(engine)() as session:
            yield session
    finally:
        engine.dispose()


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    """A table on a terminal; tab-separated lines when piped (ids stay whole and greppable)."""
    if not console.is_terminal:
        for row in [headers, *rows]:
            print("\t".join(row))
        return
    table = Table(*headers)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # cells hold server and tenant text: never markup
    console.print(table)


@contextmanager
def bad_input_exits() -> Iterator[None]:
    """Input the billing validators refuse: its message in red, exit status 2 (a usage error)."""
    try:
        yield
    except InvalidRequestError as exc:
        err_console.print(f"[red]{escape(exc.message)}[/red]")
        raise typer.Exit(2) from None


def tenant_or_exit(db: Session, ref: str) -> Tenant:
    """The tenant named by id or name, or exit 1 saying there is none."""
    found = store.get_tenant(db, tenant_ref=ref)
    if found is None:
        err_console.print(f"[red]no tenant '{ref}'[/red]")
        raise typer.Exit(1)
    return found
