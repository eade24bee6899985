"""`loraplex budgets ...`: monthly token and cost budgets of a tenant or one of its keys.

Running servers pick a change up within their budget cache's 5 s.
"""

from __future__ import annotations

import typer
from loraplex.billing.budget_status import budget_status
from loraplex.billing.quotas import delete_budget, set_budget, validate_budget_limits
from loraplex.platform.cli.common import (
    bad_input_exits,
    console,
    db_session,
    err_console,
    load_settings,
    print_table,
    tenant_or_exit,
)
from loraplex.platform.db.models import ApiKey, Tenant
from sqlalchemy.orm import Session

app = typer.Typer(help="Set, list and clear monthly budgets (429 once spent).", no_args_is_help=True)

_TENANT = typer.Option(..., "--tenant", "-t", help="Tenant name or id.")
_KEY = typer.Option(None, "--key", help="One API key's budget (key_...); default: the whole tenant's.")


@app.command("set")
def set_(
    tenant: str = _TENANT,
    key: str | None = _KEY,
    tokens: int | None = typer.Option(None, "--tokens", help="Monthly token limit (input + output)."),
    cost: str | None = typer.Option(None, "--cost", help="Monthly cost limit in USD, e.g. 25 or 12.50."),
) -> None:
    """Create or replace a budget."""
    if tokens is None and cost is None:
        err_console.print("[red]give --tokens and/or --cost (to remove a budget: loraplex budgets clear)[/red]")
        raise typer.Exit(2)
    with bad_input_exits():
        token_limit, cost_limit = validate_budget_limits(monthly_token_limit=tokens, monthly_cost_limit_usd=cost)
    with db_session(load_settings()) as db:
        found = tenant_or_exit(db, tenant)
        if key is not None:
            _tenant_key(db, found, key)
        set_budget(db, tenant_id=found.id, api_key_id=key, monthly_token_limit=token_limit,
                   monthly_cost_limit_usd=cost_limit)
        db.commit()
    console.print(f"budget set for {found.name}{' key ' + key if key else ''}")


@app.command("list")
def list_(tenant: str = _TENANT) -> None:
    """A tenant's budgets with this month's spend (from the ledger) and what is left."""
    with db_session(load_settings()) as db:
        found = tenant_or_exit(db, tenant)
        status = budget_status(db, tenant_id=found.id, guard=None)
    if not status["data"]:
        console.print(f"{found.name} has no budgets")
        return

    def cell(value: object) -> str:
        return "-" if value is None else str(value)

    print_table(
        ["scope", "token limit", "tokens used", "tokens left", "cost limit $", "cost used $", "cost left $", "resets on"],
        [
            [b["api_key_id"] or "tenant", cell(b["monthly_token_limit"]), str(b["used_tokens"]),
             cell(b["remaining_tokens"]), cell(b["monthly_cost_limit_usd"]), b["used_cost_usd"],
             cell(b["remaining_cost_usd"]), b["resets_on"]]
            for b in status["data"]
        ],
    )


@app.command()
def clear(tenant: str = _TENANT, key: str | None = _KEY) -> None:
    """Remove a budget (the tenant's, or one key's with --key)."""
    with db_session(load_settings()) as db:
        found = tenant_or_exit(db, tenant)
        if not delete_budget(db, tenant_id=found.id, api_key_id=key):
            err_console.print(f"[red]no budget for {'key ' + key if key else found.name + ' as a whole'}[/red]")
            raise typer.Exit(1)
        db.commit()
    console.print(f"budget cleared for {found.name}{' key ' + key if key else ''}")


def _tenant_key(db: Session, tenant: Tenant, key_id: str) -> None:
    record = db.get(ApiKey, key_id)
    if record is None or record.tenant_id != tenant.id:
        err_console.print(f"[red]tenant {tenant.name} has no API key {key_id!r}[/red]")
        raise typer.Exit(1)
