"""`loraplex serve`: model, database, optional demo tenant, then the engine core and the API servers.

The process layout (platform/supervisor.py): this process supervises one
engine-core process and `--api-servers` uvicorn processes sharing the port.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from loraplex.platform.auth import store
from loraplex.platform.auth.scopes import Scope
from loraplex.platform.cli.common import console, db_session, load_settings
from loraplex.platform.request_context import configure_logging
from loraplex.platform.settings import Settings

DEMO_TENANT = "demo"


def ensure_demo_key(settings: Settings) -> str | None:
    """Create the demo tenant and a key for it on first run; the key is returned (to print) only then."""
    with db_session(settings) as db:
        if store.get_tenant(db, tenant_ref=DEMO_TENANT) is not None:
            return None
        tenant = store.create_tenant(db, name=DEMO_TENANT)
        created = store.create_api_key(
            db, tenant=tenant, scopes=[Scope.INFERENCE, Scope.ADAPTERS, Scope.USAGE], name="demo"
        )
        return created.key


def serve(
    host: str | None = typer.Option(None, help="Bind address (default: LORAPLEX_HOST or 127.0.0.1)."),
    port: int | None = typer.Option(None, help="Port (default: LORAPLEX_PORT or 8000)."),
    demo: bool = typer.Option(False, "--demo", help="Create a 'demo' tenant and print its API key once."),
    model_path: str | None = typer.Option(None, help="HF model folder (default: the bundled SmolLM2-135M)."),
    api_servers: int | None = typer.Option(
        None, "--api-servers", min=1, max=64,
        help="API server processes sharing the port and one engine core (default: LORAPLEX_API_SERVERS, else 1 "
             "without Redis and min(8, cores // 2) with LORAPLEX_REDIS_URL).",
    ),
) -> None:
    """Serve the OpenAI-compatible API (converts the bundled model and migrates SQLite on first run)."""
    # model_copy skips the settings' validators: a path given here is made absolute here, as settings do.
    absolute_model_path = Path(model_path).expanduser().absolute() if model_path else None
    overrides: dict[str, Any] = {
        k: v for k, v in {"host": host, "port": port, "model_path": absolute_model_path,
                          "api_servers": api_servers}.items() if v
    }
    settings = load_settings().model_copy(update=overrides) if overrides else load_settings()
    configure_logging(settings.log_level)
    model = settings.resolve_model_path()  # shows a progress bar the first time (GGUF conversion)
    console.print(f"model: {model}")
    if demo:
        key = ensure_demo_key(settings)
        if key:
            console.print(f"\n[bold green]demo tenant created.[/bold green] Its API key (shown only now):\n\n  {key}\n")
        else:
            console.print("demo tenant exists; new key: loraplex keys create --tenant demo --scopes inference")

    from loraplex.platform.db.migrate import prepare_database
    from loraplex.platform.supervisor import Supervisor

    if settings.num_api_servers > 1 and not settings.redis_url:
        console.print("[bold yellow]warning:[/bold yellow] several API servers without LORAPLEX_REDIS_URL keep "
                      "sessions, responses and rate limits per process: a client may not find its session on "
                      "the next request. Set LORAPLEX_REDIS_URL to share them.")
    settings = settings.model_copy(update={"model_path": model})
    prepare_database(settings)  # once, here: N API servers must not race to migrate
    console.print(f"serving on http://{settings.host}:{settings.port}/v1 "
                  f"(1 engine core, {settings.api_servers} API server process(es))")
    raise typer.Exit(Supervisor(settings).run())
