"""`loraplex tenants ...`."""

from __future__ import annotations

import typer
from loraplex.platform.auth import store
from loraplex.platform.cli.common import console, db_session, err_console, load_settings, print_table

app = typer.Typer(help="Create and list tenants.", no_args_is_help=True)


@app.command()
def create(name: str = typer.Argument(..., help="Unique tenant name, e.g. acme.")) -> None:
    """Create a tenant (then give it a key: loraplex keys create --tenant NAME)."""
    with db_session(load_settings()) as db:
        try:
            tenant = store.create_tenant(db, name=name)
        except store.TenantExistsError as exc:
            err_console.print(f"[red]{exc}[/red]")
            raise typer.Exit(1) from None
        console.print(f"created tenant [bold]{tenant.name}[/bold] ({tenant.id})")


@app.command("list")
def list_() -> None:
    """List tenants."""
    with db_session(load_settings()) as db:
        rows = [[t.id, t.name, t.created_at.isoformat(timespec="seconds")] for t in store.list_tenants(db)]
    print_table(["id", "name", "created"], rows)
