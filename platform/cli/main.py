"""Entry point of the `loraplex` command."""

from __future__ import annotations

import typer
from loraplex.platform.cli import adapters, batches, budgets, db, keys, prices, tenants, usage
from loraplex.platform.cli.serve import serve

app = typer.Typer(
    name="loraplex",
    help="Multi-tenant LLM API: serve the OpenAI-compatible API, migrate the database, manage tenants and keys.\n\n"
    "Configuration comes from LORAPLEX_* environment variables (see docs/configuration.md).",
    no_args_is_help=True,
    add_completion=False,
)
app.command(help="Serve the OpenAI-compatible API.")(serve)
app.add_typer(db.app, name="db")
app.add_typer(tenants.app, name="tenants")
app.add_typer(keys.app, name="keys")
app.add_typer(usage.app, name="usage")
app.add_typer(adapters.app, name="adapters")
app.add_typer(prices.app, name="prices")
app.add_typer(budgets.app, name="budgets")
app.add_typer(batches.app, name="batches")

if __name__ == "__main__":
    app()
