"""Upload a PEFT folder through the real `/v1/adapters` route and wait until it is ready to serve."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def upload_adapter(server: Any, name: str, folder: Path, *, key_label: str = "all", timeout_s: float = 300) -> str:
    """The adapter's id, once validation has made it `ready` (fails the test on any other outcome)."""
    headers = {"Authorization": f"Bearer {server.keys[key_label]}"}
    files = [("file", (n, (folder / n).read_bytes(), "application/octet-stream")) for n in PEFT_FILES]
    created = httpx.post(f"{server.base_url}/v1/adapters", data={"name": name}, files=files, headers=headers,
                         timeout=120)
    assert created.status_code == 202, created.text
    adapter_id = created.json()["id"]
    deadline = time.monotonic() + timeout_s
    while (body := httpx.get(f"{server.base_url}/v1/adapters/{adapter_id}", headers=headers,
                             timeout=30).json())["status"] == "validating":
        assert time.monotonic() < deadline, f"adapter {name} still validating after {timeout_s:g}s"
        time.sleep(0.2)
    assert body["status"] == "ready", body
    return adapter_id
