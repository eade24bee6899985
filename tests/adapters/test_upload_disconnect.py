"""A client that disconnects in the middle of `POST /v1/adapters` is a normal abort: no error logged, nothing left."""

from __future__ import annotations

import logging
import socket
from urllib.parse import urlsplit

import pytest
from api_helpers import folder_files
from log_capture import captured_logs
from random_adapters import write_random_adapter
from waiting import wait_until

BOUNDARY = "lpxdisconnectboundary"


@pytest.fixture(scope="module")
def server(start_server):  # type: ignore[no-untyped-def]
    with start_server() as running:
        yield running


@pytest.fixture
def records():  # type: ignore[no-untyped-def]
    router_log = logging.getLogger("loraplex.platform.routers.adapters")
    old_level = router_log.level
    router_log.setLevel(logging.INFO)  # the abort is logged at INFO; see it even when the root is at WARNING
    try:
        with captured_logs("uvicorn.error", "loraplex.platform.errors", router_log.name) as handler:
            yield handler
    finally:
        router_log.setLevel(old_level)


def _leftovers(server):  # type: ignore[no-untyped-def]
    service = server.services.extensions.domain_state["adapters"].service
    staged = sorted(p.name for p in service.staging_root.iterdir()) if service.staging_root.exists() else []
    return service.store.count(), len(service.registry.list(tenant_id=server.tenants["acme"])), staged


def test_disconnect_mid_upload_is_a_quiet_abort(server, records, tmp_path, smollm_spec):  # type: ignore[no-untyped-def]
    files = dict(folder_files(write_random_adapter(tmp_path / "a", smollm_spec, r=4, targets=("q_proj", "v_proj"))))
    weights = files["adapter_model.safetensors"]
    head = (
        f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\ncut-off\r\n"
        f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"adapter_config.json\"\r\n"
        f"Content-Type: application/json\r\n\r\n"
    ).encode() + files["adapter_config.json"] + (
        f"\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
        f"filename=\"adapter_model.safetensors\"\r\nContent-Type: application/octet-stream\r\n\r\n"
    ).encode()
    total = len(head) + len(weights) + len(f"\r\n--{BOUNDARY}--\r\n")
    before = _leftovers(server)
    assert before[2] == []

    url = urlsplit(server.base_url)
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall((
        f"POST /v1/adapters HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Authorization: Bearer {server.keys['adapters']}\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\nContent-Length: {total}\r\n\r\n"
    ).encode() + head + weights[: len(weights) // 2])
    service = server.services.extensions.domain_state["adapters"].service
    # the server is streaming our half-sent body into a staging folder
    wait_until(lambda: _leftovers(server)[2], timeout_s=20, what="the upload to reach the staging folder")
    staged_file = next(service.staging_root.iterdir()) / "adapter_model.safetensors"
    wait_until(staged_file.exists, timeout_s=20, what=f"{staged_file} to be written")
    sock.close()  # gone mid-body

    wait_until(lambda: any("client disconnected" in r.getMessage() for r in records.records), timeout_s=20,
               what=lambda: f"the disconnect to be logged: {[r.getMessage() for r in records.records]}")
    # the staging folder goes right after the abort
    wait_until(lambda: not _leftovers(server)[2], timeout_s=20,
               what=lambda: f"the staging folder to go: {_leftovers(server)}")
    assert _leftovers(server) == before  # no blob, no row, no staging file
    errors = [r for r in records.records if r.levelno >= logging.ERROR or r.exc_info]
    assert errors == [], [(r.name, r.getMessage()) for r in errors]

    # The server is unharmed: the same upload sent whole is accepted.
    import httpx

    response = httpx.post(
        f"{server.base_url}/v1/adapters", data={"name": "whole"},
        files=[("file", (n, d, "application/octet-stream")) for n, d in files.items()],
        headers={"Authorization": f"Bearer {server.keys['adapters']}"}, timeout=60,
    )
    assert response.status_code == 202, response.text
