"""`loraplex batches ...`: submit a JSONL file, list, show, cancel and download batches on a running server.

Like `loraplex adapters`, these talk to the server over HTTP with a tenant's
API key (scope `inference`): the Batch API (`/v1/files`, `/v1/batches`) is
what they call, so they see exactly what the openai SDK would.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import typer
from loraplex.platform.cli.adapters import BaseUrl, _call, _client
from loraplex.platform.cli.common import console, err_console, print_table
from rich.markup import escape

app = typer.Typer(help="Run OpenAI Batch API jobs (JSONL files of requests) on a running server.",
                  no_args_is_help=True)
ApiKey = typer.Option(..., "--api-key", envvar="LORAPLEX_API_KEY", show_default=False,
                      help="An API key with the 'inference' scope (env LORAPLEX_API_KEY).")
TERMINAL = ("completed", "failed", "expired", "cancelled")


def _progress(batch: dict) -> str:
    counts = batch["request_counts"]
    done = counts["completed"] + counts["failed"]
    share = f"{100 * done / counts['total']:.0f}%" if counts["total"] else "-"
    return f"{done}/{counts['total']} ({share}), {counts['failed']} failed"


def _when(stamp: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp)) if stamp else "-"


@app.command()
def create(
    path: Path = typer.Argument(..., exists=True, dir_okay=False, help="A JSONL file: one request per line, "
                                "{custom_id, method: POST, url, body}."),
    endpoint: str = typer.Option("/v1/chat/completions", "--endpoint", "-e",
                                 help="/v1/chat/completions, /v1/completions or /v1/responses."),
    metadata: list[str] = typer.Option([], "--metadata", "-m", help="key=value, repeatable (at most 16)."),
    wait: bool = typer.Option(False, "--wait", help="Wait until the batch ends, showing its progress."),
    base_url: str = BaseUrl,
    api_key: str = ApiKey,
) -> None:
    """Upload the file and start a batch over it; prints the batch id."""
    pairs = dict(item.split("=", 1) for item in metadata if "=" in item)
    if len(pairs) != len(metadata):
        raise typer.BadParameter("give metadata as key=value", param_hint="--metadata")
    with _client(base_url, api_key) as client, path.open("rb") as f:
        uploaded = _call(client, "POST", "/v1/files", data={"purpose": "batch"}, files={"file": (path.name, f)})
        batch = _call(client, "POST", "/v1/batches", json={
            "input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": "24h",
            **({"metadata": pairs} if pairs else {})})
    err_console.print(f"uploaded {path.name} as {uploaded['id']}; batch {batch['id']} is {batch['status']}")
    if wait:
        batch = _wait(base_url, api_key, batch["id"])
        err_console.print(f"{batch['status']}: {_progress(batch)}")
    print(batch["id"])
    if wait and batch["status"] != "completed":
        raise typer.Exit(1)


def _wait(base_url: str, api_key: str, batch_id: str) -> dict:
    with _client(base_url, api_key) as client, err_console.status("") as status:
        while True:
            batch = _call(client, "GET", f"/v1/batches/{batch_id}")
            if batch["status"] in TERMINAL:
                return batch
            status.update(f"{batch['status']}: {_progress(batch)}")
            time.sleep(1.0)


@app.command("list")
def list_(
    limit: int = typer.Option(20, "--limit", min=1, max=100, help="Batches per page (newest first)."),
    after: str | None = typer.Option(None, "--after", help="The last batch id of the page before."),
    as_json: bool = typer.Option(False, "--json", help="Print the server's JSON instead of a table."),
    base_url: str = BaseUrl,
    api_key: str = ApiKey,
) -> None:
    """Your batches, newest first, with their progress."""
    params: dict[str, str | int] = {"limit": limit, **({"after": after} if after else {})}
    with _client(base_url, api_key) as client:
        page = _call(client, "GET", "/v1/batches", params=params)
    if as_json:
        print(json.dumps(page, indent=2))
        return
    rows = [[b["id"], b["status"], b["endpoint"], _progress(b), _when(b["created_at"]), b["output_file_id"] or "-",
             b["error_file_id"] or "-"] for b in page["data"]]
    print_table(["id", "status", "endpoint", "progress", "created", "output file", "error file"], rows)
    if page["has_more"]:
        err_console.print(f"more: --after {page['last_id']}")


@app.command()
def show(
    batch_id: str = typer.Argument(..., help="The batch's id."),
    as_json: bool = typer.Option(False, "--json", help="Print the server's JSON."),
    base_url: str = BaseUrl,
    api_key: str = ApiKey,
) -> None:
    """One batch: status, progress, times, files, usage and validation errors."""
    with _client(base_url, api_key) as client:
        batch = _call(client, "GET", f"/v1/batches/{batch_id}")
    if as_json:
        print(json.dumps(batch, indent=2))
        return
    usage = batch["usage"]
    console.print(f"{batch['id']}  [bold]{batch['status']}[/bold]  {batch['endpoint']}  "
                  f"model {escape(batch['model'] or '-')}")
    console.print(f"progress {_progress(batch)}")
    for name in ("created_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                 "cancelling_at", "cancelled_at", "expires_at"):
        if batch[name]:
            console.print(f"  {name.removesuffix('_at'):<12} {_when(batch[name])}")
    console.print(f"input {batch['input_file_id']}  output {batch['output_file_id'] or '-'}  "
                  f"errors {batch['error_file_id'] or '-'}")
    console.print(f"tokens: input {usage['input_tokens']} (cached {usage['input_tokens_details']['cached_tokens']}),"
                  f" output {usage['output_tokens']} (reasoning {usage['output_tokens_details']['reasoning_tokens']})")
    for error in (batch["errors"] or {}).get("data", []):
        # the message quotes the line's own text (a url, a model name): never markup
        console.print(f"[red]line {error['line']}: {error['code']}: {escape(str(error['message']))}[/red]",
                      soft_wrap=True)


@app.command()
def cancel(
    batch_id: str = typer.Argument(..., help="The batch's id."),
    base_url: str = BaseUrl,
    api_key: str = ApiKey,
) -> None:
    """Cancel a batch: lines running finish, the rest are not run (the error file lists them)."""
    with _client(base_url, api_key) as client:
        batch = _call(client, "POST", f"/v1/batches/{batch_id}/cancel")
    console.print(f"{batch['id']} {batch['status']}")


@app.command()
def download(
    batch_id: str = typer.Argument(..., help="The batch's id."),
    errors: bool = typer.Option(False, "--errors", help="The error file instead of the output file."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write here instead of to stdout."),
    base_url: str = BaseUrl,
    api_key: str = ApiKey,
) -> None:
    """The batch's output (or error) file, as JSONL."""
    with _client(base_url, api_key) as client:
        batch = _call(client, "GET", f"/v1/batches/{batch_id}")
        file_id = batch["error_file_id" if errors else "output_file_id"]
        if file_id is None:
            err_console.print(f"batch {batch_id} ({batch['status']}) has no {'error' if errors else 'output'} file")
            raise typer.Exit(1)
        try:
            with client.stream("GET", f"/v1/files/{file_id}/content") as response:
                if not response.is_success:
                    response.read()
                    err_console.print(f"[red]error {response.status_code}: {escape(response.text[:500])}[/red]")
                    raise typer.Exit(1)
                target = output.open("wb") if output else sys.stdout.buffer
                try:
                    for chunk in response.iter_bytes():
                        target.write(chunk)
                finally:
                    if output:
                        target.close()
        except httpx.HTTPError as exc:
            err_console.print(f"[red]download failed: {escape(str(exc))}[/red]")
            raise typer.Exit(1) from None
    if output:
        err_console.print(f"wrote {output}")
