"""`loraplex adapters ...`: upload (with a progress bar, then wait for validation), list, delete.

Unlike the other commands, which open the database directly, these talk to a
running server over HTTP with a tenant's API key (scope `adapters`): uploads
must go through the server's checks and its validation queue.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import typer
from loraplex.platform.cli.common import console, err_console, print_table
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

app = typer.Typer(help="Upload, list and delete your LoRA adapters on a running server.", no_args_is_help=True)

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz")
CHUNK_BYTES = 256 * 1024

BaseUrl = typer.Option("http://127.0.0.1:8000", "--base-url", envvar="LORAPLEX_BASE_URL",
                       help="The server's address (env LORAPLEX_BASE_URL).")
ApiKey = typer.Option(..., "--api-key", envvar="LORAPLEX_API_KEY", show_default=False,
                      help="An API key with the 'adapters' scope (env LORAPLEX_API_KEY).")


# ---- the multipart body, streamed from disk ------------------------------------------------------

@dataclass(slots=True)
class MultipartUpload:
    """A multipart/form-data body generated chunk by chunk; `on_bytes(n)` is told of every chunk sent."""

    fields: dict[str, str]
    files: list[Path]
    boundary: str

    @classmethod
    def for_path(cls, path: Path, fields: dict[str, str]) -> MultipartUpload:
        if path.is_dir():
            missing = [n for n in ADAPTER_FILES if not (path / n).is_file()]
            if missing:
                raise typer.BadParameter(f"{path} lacks {', '.join(missing)}", param_hint="PATH")
            files = [path / n for n in ADAPTER_FILES]
        elif path.is_file() and path.name.endswith(ARCHIVE_SUFFIXES):
            files = [path]
        else:
            raise typer.BadParameter(
                f"{path}: give a folder with {' + '.join(ADAPTER_FILES)}, or a .zip / .tar.gz", param_hint="PATH"
            )
        return cls(fields=fields, files=files, boundary=f"loraplex-{secrets.token_hex(12)}")

    @property
    def content_type(self) -> str:
        return f"multipart/form-data; boundary={self.boundary}"

    def _field_head(self, name: str) -> bytes:
        return f'--{self.boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()

    def _file_head(self, path: Path) -> bytes:
        return (f'--{self.boundary}\r\nContent-Disposition: form-data; name="file"; '
                f'filename="{path.name}"\r\nContent-Type: application/octet-stream\r\n\r\n').encode()

    def _tail(self) -> bytes:
        return f"--{self.boundary}--\r\n".encode()

    @property
    def file_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files)

    @property
    def content_length(self) -> int:
        size = sum(len(self._field_head(k)) + len(v.encode()) + 2 for k, v in self.fields.items())
        size += sum(len(self._file_head(p)) + p.stat().st_size + 2 for p in self.files)
        return size + len(self._tail())

    def chunks(self, on_bytes: Callable[[int], None]) -> Iterator[bytes]:
        for name, value in self.fields.items():
            yield self._field_head(name) + value.encode() + b"\r\n"
        for path in self.files:
            yield self._file_head(path)
            with path.open("rb") as f:
                while chunk := f.read(CHUNK_BYTES):
                    yield chunk
                    on_bytes(len(chunk))
            yield b"\r\n"
        yield self._tail()


# ---- HTTP ------------------------------------------------------------------------------------------

def _client(base_url: str, api_key: str) -> httpx.Client:
    return httpx.Client(base_url=base_url.rstrip("/"), headers={"Authorization": f"Bearer {api_key}"},
                        timeout=httpx.Timeout(60.0, connect=10.0))


def _call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> Any:
    """The JSON body of a 2xx reply; otherwise the server's error message and exit code 1."""
    try:
        response = client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        err_console.print(f"[red]cannot reach {client.base_url}: {escape(str(exc))}[/red]")
        raise typer.Exit(1) from None
    if response.is_success:
        return response.json()
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:500]
    err_console.print(f"[red]error {response.status_code}: {escape(str(message))}[/red]")
    raise typer.Exit(1)


# ---- commands --------------------------------------------------------------------------------------

@app.command()
def upload(
    path: Path = typer.Argument(..., help="A folder with adapter_config.json + adapter_model.safetensors, "
                                           "or a .zip / .tar.gz holding them."),
    name: str = typer.Option(..., "--name", "-n", help="The adapter's name (what `model=` will use)."),
    description: str = typer.Option("", "--description", "-d", help="A short description."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait for validation and print the result."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait for validation."),
    base_url: str = BaseUrl,
    api_key: str = ApiKey,
) -> None:
    """Upload an adapter (progress bar), then wait for validation: exit code 1 if it fails."""
    body = MultipartUpload.for_path(path, {"name": name, "description": description})
    progress = Progress(TextColumn("uploading {task.description}"), BarColumn(), DownloadColumn(),
                        TransferSpeedColumn(), console=err_console)
    with _client(base_url, api_key) as client, progress:
        task = progress.add_task(path.name, total=body.file_bytes)
        created = _call(client, "POST", "/v1/adapters", content=body.chunks(lambda n: progress.advance(task, n)),
                        headers={"Content-Type": body.content_type, "Content-Length": str(body.content_length)})
    err_console.print(f"uploaded {escape(created['name'])} ({created['id']}); validating…")
    if not wait:
        print(created["id"])
        return
    info = _wait_for_validation(base_url, api_key, created["id"], timeout)
    if info["status"] == "ready":
        console.print(
            f"[green]ready[/green] {escape(info['name'])} ({info['id']}): rank {info['rank']}, alpha {info['alpha']}, "
            f"targets {','.join(info['target_modules'] or [])}, {info['size_bytes']} bytes, "
            f"sha256 {info['sha256']}", soft_wrap=True,
        )
        return
    if info["status"] == "failed":
        console.print(f"[red]failed[/red] {escape(info['name'])} ({info['id']}): {escape(str(info['reason']))}",
                      soft_wrap=True)
    else:
        console.print(f"[yellow]still {info['status']}[/yellow] after {timeout:.0f}s: {info['id']}")
    raise typer.Exit(1)


def _wait_for_validation(base_url: str, api_key: str, adapter_id: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    delay = 0.2
    with _client(base_url, api_key) as client, err_console.status("validating…"):
        while True:
            info = _call(client, "GET", f"/v1/adapters/{adapter_id}")
            if info["status"] != "validating" or time.monotonic() > deadline:
                return info
            time.sleep(delay)
            delay = min(delay * 1.5, 2.0)  # quick for small adapters, gentle on the server for big ones


@app.command("list")
def list_(
    as_json: bool = typer.Option(False, "--json", help="Print the server's JSON instead of a table."),
    base_url: str = BaseUrl,
    api_key: str = ApiKey,
) -> None:
    """List your adapters with their status."""
    with _client(base_url, api_key) as client:
        data = _call(client, "GET", "/v1/adapters")["data"]
    if as_json:
        print(json.dumps(data, indent=2))
        return
    rows = [
        [a["id"], a["name"], a["status"], str(a["rank"] or "-"), ",".join(a["target_modules"] or []) or "-",
         str(a["size_bytes"]), a["reason"] or ""]
        for a in data
    ]
    print_table(["id", "name", "status", "rank", "targets", "bytes", "reason"], rows)


@app.command()
def delete(
    adapter_id: str = typer.Argument(..., help="The adapter's id, from `loraplex adapters list`."),
    base_url: str = BaseUrl,
    api_key: str = ApiKey,
) -> None:
    """Delete an adapter (refused while requests use it)."""
    with _client(base_url, api_key) as client:
        _call(client, "DELETE", f"/v1/adapters/{adapter_id}")
    console.print(f"deleted {adapter_id}")
