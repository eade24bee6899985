"""`loraplex prices ...`: the price book (USD per million tokens). Rows are never edited: a change is a new row.

Running servers pick a new price up within their price cache's 30 s.
"""

from __future__ import annotations

from datetime import datetime

import typer
from loraplex.adapters.models import AdapterRecord
from loraplex.billing.pricing import list_prices, micro_to_usd, usd_text, validate_new_price
from loraplex.platform.cli.common import (
    bad_input_exits,
    console,
    db_session,
    err_console,
    load_settings,
    print_table,
)

app = typer.Typer(help="Add and list prices (USD per million tokens).", no_args_is_help=True)


@app.command()
def add(
    model: str = typer.Option(..., "--model", "-m", help="Served model name, or * for any model."),
    adapter: str | None = typer.Option(None, "--adapter", help="Adapter id (adp_...); default: any adapter."),
    input_usd: str = typer.Option(..., "--input", help="USD per million uncached input tokens, e.g. 0.15."),
    output_usd: str = typer.Option(..., "--output", help="USD per million output tokens."),
    cached_input_usd: str | None = typer.Option(None, "--cached-input", help="Default: the input price."),
    thinking_usd: str | None = typer.Option(None, "--thinking", help="Default: the output price."),
    effective_from: str | None = typer.Option(None, "--effective-from",
                                              help="ISO date-time (UTC unless it says); default now; never past."),
) -> None:
    """Add a price; it applies to requests that arrive from its effective time on."""
    try:
        moment = None if effective_from is None else datetime.fromisoformat(effective_from)
    except ValueError:
        err_console.print(f"[red]--effective-from must be an ISO date-time like 2026-12-01T00:00:00Z, "
                          f"not {effective_from!r}[/red]")
        raise typer.Exit(2) from None
    with bad_input_exits():
        new = validate_new_price(
            model=model, adapter_id=adapter, input_usd=input_usd, output_usd=output_usd,
            cached_input_usd=cached_input_usd, thinking_usd=thinking_usd, effective_from=moment,
        )
    with db_session(load_settings()) as db:
        if new.adapter_id is not None and db.get(AdapterRecord, new.adapter_id) is None:
            err_console.print(f"[red]no adapter {new.adapter_id!r}[/red]")
            raise typer.Exit(1)
        row = new.add_to(db)
        db.commit()
        console.print(f"added price {row.id} for {row.model}{' / ' + row.adapter_id if row.adapter_id else ''} "
                      f"from {new.effective_from.isoformat(timespec='seconds')}")


@app.command("list")
def list_(model: str | None = typer.Option(None, "--model", "-m", help="Only this model's rows.")) -> None:
    """Every price, newest first; `in force` marks the one each model/adapter pair pays now."""
    with db_session(load_settings()) as db:
        rows = list_prices(db, model=model)
    print_table(
        ["id", "model", "adapter", "input", "cached input", "output", "thinking", "effective from", "in force"],
        [
            [str(p.id), p.model, p.adapter_id or "*", *(usd_text(micro_to_usd(v)) for v in
                                                       (p.input, p.cached_input, p.output, p.thinking)),
             p.effective_from.isoformat(timespec="seconds"), "yes" if in_force else ""]
            for p, in_force in rows
        ],
    )
