"""`loraplex keys ...`: API keys, shown once at creation."""

from __future__ import annotations

import typer
from loraplex.platform.auth import store
from loraplex.platform.auth.revocation import announce_if_configured
from loraplex.platform.auth.scopes import Scope, parse_scopes
from loraplex.platform.cli.common import console, db_session, err_console, load_settings, print_table

app = typer.Typer(help="Create, list and revoke API keys.", no_args_is_help=True)

_SCOPES_HELP = f"Comma-separated scopes: {', '.join(s.value for s in Scope)}."


@app.command()
def create(
    tenant: str = typer.Option(..., "--tenant", "-t", help="Tenant name or id."),
    scopes: str = typer.Option("inference", "--scopes", "-s", help=_SCOPES_HELP),
    name: str = typer.Option("", "--name", "-n", help="A label for the key."),
    rpm: int | None = typer.Option(None, "--rpm", help="Requests per minute (default: server setting)."),
    tpm: int | None = typer.Option(None, "--tpm", help="Tokens per minute (default: server setting)."),
) -> None:
    """Create an API key and print it ONCE (only its hash is stored)."""
    try:
        scope_list = parse_scopes(scopes)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--scopes") from None
    with db_session(load_settings()) as db:
        record = store.get_tenant(db, tenant_ref=tenant)
        if record is None:
            err_console.print(f"[red]no tenant {tenant!r}[/red] (create it: loraplex tenants create {tenant})")
            raise typer.Exit(1)
        created = store.create_api_key(db, tenant=record, scopes=scope_list, name=name, rpm_limit=rpm, tpm_limit=tpm)
    err_console.print(
        f"created key {created.record.id} for tenant {record.name} with scopes {created.record.scopes}; "
        "it is shown only now:"
    )
    print(created.key)  # plain stdout, so `KEY=$(loraplex keys create ...)` works


@app.command("list")
def list_(tenant: str | None = typer.Option(None, "--tenant", "-t", help="Only this tenant's keys.")) -> None:
    """List keys (prefix, scopes, last use; never the key itself)."""
    with db_session(load_settings()) as db:
        tenant_id = None
        if tenant is not None:
            record = store.get_tenant(db, tenant_ref=tenant)
            if record is None:
                err_console.print(f"[red]no tenant {tenant!r}[/red]")
                raise typer.Exit(1)
            tenant_id = record.id
        rows = [
            [
                key.id, key.tenant_id, key.key_prefix + "…", key.scopes,
                key.last_used_at.isoformat(timespec="seconds") if key.last_used_at else "never",
                key.revoked_at.isoformat(timespec="seconds") if key.revoked_at else "",
            ]
            for key in store.list_api_keys(db, tenant_id=tenant_id)
        ]
    print_table(["id", "tenant", "prefix", "scopes", "last used", "revoked"], rows)


@app.command()
def revoke(key_id: str = typer.Argument(..., help="The key's id (key_...), from `loraplex keys list`.")) -> None:
    """Revoke a key; requests with it fail from the next one on."""
    settings = load_settings()
    with db_session(settings) as db:
        record = store.revoke_api_key(db, key_id=key_id)
    if record is None:
        err_console.print(f"[red]no key {key_id!r}[/red]")
        raise typer.Exit(1)
    announce_if_configured(settings, record.id)  # running servers drop it at once, not after their cache time
    console.print(f"revoked {record.id}")
