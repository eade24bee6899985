"""`loraplex tenants ...`."""

from __future__ import annotations

import typer
from loraplex.platform.auth import store
from loraplex.platform.cli.common import console, db_session, err_console, load_settings, print_table
from rich.markup import escape

app = typer.Typer(help="Create and list tenants.", no_args_is_help=True)


def _checked_weight(weight: float) -> float:
    if not store.MIN_TENANT_WEIGHT <= weight <= store.MAX_TENANT_WEIGHT:
        err_console.print(f"[red]the weight must be in [{store.MIN_TENANT_WEIGHT}, {store.MAX_TENANT_WEIGHT}][/red]")
        raise typer.Exit(2)
    return weight


@app.command()
def create(
    name: str = typer.Argument(..., help="Unique tenant name, e.g. acme."),
    weight: float = typer.Option(1.0, help="Its weight in the engine's fair sharing (2: twice an ordinary share)."),
) -> None:
    """Create a tenant (then give it a key: loraplex keys create --tenant NAME)."""
    with db_session(load_settings()) as db:
        try:
            tenant = store.create_tenant(db, name=name, weight=_checked_weight(weight))
        except store.TenantExistsError as exc:
            err_console.print(f"[red]{escape(str(exc))}[/red]")
            raise typer.Exit(1) from None
        console.print(f"created tenant [bold]{tenant.name}[/bold] ({tenant.id})")


@app.command("set-weight")
def set_weight(
    tenant: str = typer.Argument(..., help="Tenant name or id."),
    weight: float = typer.Argument(..., help="Its weight in the engine's fair sharing (1 is the default)."),
) -> None:
    """Change a tenant's fair-sharing weight (servers apply it as their key caches refresh)."""
    with db_session(load_settings()) as db:
        updated = store.set_tenant_weight(db, tenant_ref=tenant, weight=_checked_weight(weight))
        if updated is None:
            err_console.print(f"[red]no tenant {tenant!r}[/red]")
            raise typer.Exit(1)
        console.print(f"tenant [bold]{updated.name}[/bold] now has weight {updated.weight:g}")


@app.command("list")
def list_() -> None:
    """List tenants."""
    with db_session(load_settings()) as db:
        rows = [[t.id, t.name, f"{t.weight:g}", t.created_at.isoformat(timespec="seconds")]
                for t in store.list_tenants(db)]
    print_table(["id", "name", "weight", "created"], rows)
