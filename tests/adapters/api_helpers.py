"""HTTP helpers for the adapters API tests: multipart upload, adapter files, waiting for validation."""

from __future__ import annotations

import time
from pathlib import Path

import httpx


def upload(server, files: list[tuple[str, bytes]], name: str, key: str = "adapters") -> httpx.Response:  # type: ignore[no-untyped-def]
    parts = [("file", (filename, data, "application/octet-stream")) for filename, data in files]
    return httpx.post(f"{server.base_url}/v1/adapters", data={"name": name, "description": "test"}, files=parts,
                      headers={"Authorization": f"Bearer {server.keys[key]}"}, timeout=120)


def folder_files(folder: Path) -> list[tuple[str, bytes]]:
    return [(n, (folder / n).read_bytes()) for n in ("adapter_config.json", "adapter_model.safetensors")]


def wait_status(server, adapter_id: str, key: str = "adapters", timeout_s: float = 180) -> dict:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        body = httpx.get(f"{server.base_url}/v1/adapters/{adapter_id}",
                         headers={"Authorization": f"Bearer {server.keys[key]}"}, timeout=30).json()
        if body["status"] != "validating" or time.monotonic() > deadline:
            return body
        time.sleep(0.2)
