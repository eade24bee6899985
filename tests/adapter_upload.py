"""Upload a PEFT folder through the real `/v1/adapters` route and wait until it is ready to serve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from waiting import wait_until

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def upload_adapter(server: Any, name: str, folder: Path, *, key_label: str = "all", timeout_s: float = 300) -> str:
    """The adapter's id, once validation has made it `ready` (fails the test on any other outcome)."""
    headers = {"Authorization": f"Bearer {server.keys[key_label]}"}
    files = [("file", (n, (folder / n).read_bytes(), "application/octet-stream")) for n in PEFT_FILES]
    created = httpx.post(f"{server.base_url}/v1/adapters", data={"name": name}, files=files, headers=headers,
                         timeout=120)
    assert created.status_code == 202, created.text
    adapter_id = created.json()["id"]

    def validated() -> dict[str, Any] | None:
        body = httpx.get(f"{server.base_url}/v1/adapters/{adapter_id}", headers=headers, timeout=30).json()
        return None if body["status"] == "validating" else body

    body = wait_until(validated, timeout_s=timeout_s, interval_s=0.2, what=f"adapter {name} to finish validating")
    assert body["status"] == "ready", body
    return adapter_id
