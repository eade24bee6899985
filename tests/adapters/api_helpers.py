"""HTTP helpers for the adapters API tests: multipart upload, adapter files, waiting for validation."""

from __future__ import annotations

from pathlib import Path

import httpx
from waiting import wait_until


def upload(server, files: list[tuple[str, bytes]], name: str, key: str = "adapters") -> httpx.Response:  # type: ignore[no-untyped-def]
    parts = [("file", (filename, data, "application/octet-stream")) for filename, data in files]
    return httpx.post(f"{server.base_url}/v1/adapters", data={"name": name, "description": "test"}, files=parts,
                      headers={"Authorization": f"Bearer {server.keys[key]}"}, timeout=120)


def folder_files(folder: Path) -> list[tuple[str, bytes]]:
    return [(n, (folder / n).read_bytes()) for n in ("adapter_config.json", "adapter_model.safetensors")]


def wait_status(server, adapter_id: str, key: str = "adapters", timeout_s: float = 180) -> dict:  # type: ignore[no-untyped-def]
    """The adapter's record once validation has ended (ready or failed)."""

    def validated() -> dict | None:
        body = httpx.get(f"{server.base_url}/v1/adapters/{adapter_id}",
                         headers={"Authorization": f"Bearer {server.keys[key]}"}, timeout=30).json()
        return None if body["status"] == "validating" else body

    return wait_until(validated, timeout_s=timeout_s, interval_s=0.2, what=f"adapter {adapter_id} to be validated")
