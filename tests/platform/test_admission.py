"""Admission before preparation, per-tenant in-flight caps, readiness and slow readers, through a real server."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest
from waiting import wait_for_fresh_rate_window, wait_until

MODEL = "SmolLM2-135M-Instruct"
LONG = {"model": MODEL, "prompt": "Count:", "max_tokens": 1500, "ignore_eos": True, "stream": True}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _key(server: Any, **limits: int) -> str:
    created = httpx.post(f"{server.base_url}/v1/admin/tenants/acme/keys", json={"scopes": ["inference"], **limits},
                         headers=_auth(server.keys["admin"]))
    assert created.status_code == 201, created.text
    return created.json()["key"]


def _post(server: Any, path: str, body: dict[str, Any], key: str) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=_auth(key), timeout=120)


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    # a small kernel send buffer, as a remote client's path gives: over loopback a whole response fits in the buffers
    with start_server(max_inflight_per_tenant=2, stream_send_timeout_s=1, send_buffer_bytes=16384) as running:
        yield running


def test_each_prompt_of_a_list_counts_for_requests_per_minute(server: Any) -> None:
    key = _key(server, rpm_limit=3)
    wait_for_fresh_rate_window()
    two = {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 1}
    assert _post(server, "/v1/completions", two, key).status_code == 200
    refused = _post(server, "/v1/completions", two, key)  # 2 + 2 > 3
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert _post(server, "/v1/completions", {**two, "prompt": "a"}, key).status_code == 200  # 2 + 1 = 3


def test_rate_limit_refuses_before_any_preparation(server: Any) -> None:
    key = _key(server, rpm_limit=1)
    wait_for_fresh_rate_window()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert _post(server, "/v1/chat/completions", chat, key).status_code == 200
    # An unknown model and an unknown session would be 404s, found only by preparing the request:
    for body in ({**chat, "model": "no-such-model"}, {**chat, "session_id": "sess_missing"}):
        refused = _post(server, "/v1/chat/completions", body, key)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded", refused.text


def test_tenant_inflight_cap_is_429_naming_the_setting_and_spares_other_tenants(server: Any) -> None:
    key = server.keys["inference"]
    two_prompts = {**LONG, "prompt": ["Count:", "Count to ten:"]}  # two requests in flight: the cap (2)
    with httpx.stream("POST", server.base_url + "/v1/completions", json=two_prompts, headers=_auth(key),
                      timeout=120) as s:
        assert s.status_code == 200
        lines = s.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)
        refused = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}, key)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "tenant_inflight_limit" and "max_inflight_per_tenant" in error["message"]
        other = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1},
                      server.keys["globex"])
        assert other.status_code == 200
    wait_until(lambda: not server.services.inflight_by_tenant, timeout_s=15, interval_s=0.1,
               what=lambda: f"the closed stream's slot to return: {server.services.inflight_by_tenant}")
    assert _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}, key).status_code == 200


def test_a_stream_nobody_reads_is_ended_and_its_slot_returns(server: Any) -> None:
    host, port = server.base_url.removeprefix("http://").split(":")
    # echo + logprobs: the first chunk carries 20 alternatives for each of ~400 prompt tokens (hundreds of KB),
    # more than the socket buffers hold, so the server's send blocks at once.
    body = json.dumps({**LONG, "prompt": "one two three four " * 100, "echo": True, "logprobs": 20,
                       "max_tokens": 400}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {server.keys['inference']}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                     + body)
        engine = server.services.engine
        generated_before = engine.stats()["generation_tokens_total"]
        wait_until(lambda: engine.stats()["num_running"], timeout_s=10, interval_s=0.05,
                   what="the request to start running")
        assert engine.stats()["num_running"] == 1
        # buffers fill, then one second without a read ends the stream
        wait_until(lambda: not server.services.num_inflight, timeout_s=60, interval_s=0.2,
                   what="the unread stream to give back its slot")
        assert engine.stats()["num_running"] == 0
        generated = engine.stats()["generation_tokens_total"] - generated_before
        assert generated < 200, f"the stream ran {generated} of its 400 tokens: it was not cut when its sends stalled"
    finally:
        sock.close()


def _raw_post(server: Any, body: bytes) -> socket.socket:
    """A request on a raw socket with a small receive buffer, as a client that may never read its answer."""
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {server.keys['inference']}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                 + body)
    return sock


def _read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """What the server sent, and whether it closed the connection (EOF or reset) within `timeout_s`."""
    sock.settimeout(timeout_s)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except (ConnectionResetError, TimeoutError) as exc:
        return received, isinstance(exc, ConnectionResetError)
    return received, True


def _server_side_open(server_port: int, client_port: int) -> bool:
    """Whether the kernel still holds the server's end of the connection from `client_port` (IPv4 loopback)."""
    local, remote = f"0100007F:{server_port:04X}", f"0100007F:{client_port:04X}"
    with open("/proc/net/tcp") as table:
        return any(fields[1] == local and fields[2] == remote
                   for fields in (line.split() for line in table.readlines()[1:]))


def test_a_whole_response_nobody_reads_is_cut_and_its_connection_closed(server: Any) -> None:
    # Not streamed: one body of hundreds of KB (echo + 20 alternatives per prompt token), sent in one go. Its send
    # waits on a client that reads nothing; past the send timeout (1 s here) the server gives up on it, and the
    # kernel closes the connection (TCP_USER_TIMEOUT), rather than the event loop holding the body for as long as
    # the client keeps the connection open.
    body = json.dumps({"model": MODEL, "prompt": "one two three four " * 100, "echo": True, "logprobs": 20,
                       "max_tokens": 4}).encode()
    sock = _raw_post(server, body)
    server_port, client_port = int(server.base_url.rsplit(":", 1)[1]), sock.getsockname()[1]
    try:
        # Reading nothing until the server's end is gone: a read before then would open the window and let the
        # rest flow. How soon it goes depends on the machine's load (the guard's sweep, the kernel's window
        # probes: a few seconds), so the wait is for the event, with a generous bound.
        wait_until(lambda: not _server_side_open(server_port, client_port), timeout_s=60, interval_s=0.2,
                   what="the server to drop the connection of a client that reads nothing")
        assert not server.services.num_inflight
        received, closed = _read_until_closed(sock, timeout_s=20)
        assert received.startswith(b"HTTP/1.1 200"), received[:200]
        assert closed, "the client's end saw neither EOF nor reset after the server's end was gone"
        payload = received.split(b"\r\n\r\n", 1)[1]
        assert not payload.rstrip().endswith(b"}"), "the whole body was delivered: the send was never cut"
    finally:
        sock.close()
    # the server is fine for everyone else
    assert _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1},
                 server.keys["inference"]).status_code == 200


def test_served_connections_inherit_the_unread_timeout(server: Any) -> None:
    from loraplex.platform.supervisor import bind_socket

    listener = bind_socket("127.0.0.1", 0, unread_timeout_s=2.5)
    listener.listen()
    try:
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 2500
        accepted.close()
        client.close()
    finally:
        listener.close()


def test_readyz(server: Any) -> None:
    ready = httpx.get(server.base_url + "/readyz", timeout=10)
    assert ready.status_code == 200 and ready.json() == {"status": "ready", "not_ready": {}}
    server.services.draining = True
    try:
        draining = httpx.get(server.base_url + "/readyz", timeout=10)
    finally:
        server.services.draining = False
    assert draining.status_code == 503 and set(draining.json()["not_ready"]) == {"draining"}
    assert httpx.get(server.base_url + "/healthz", timeout=10).status_code == 200  # alive while draining


def test_readyz_names_an_unreachable_database_and_notes_a_missing_celery_worker(start_server: Any, redis_url: str,
                                                                               redis_prefix: str) -> None:
    with start_server(redis_url=redis_url, redis_key_prefix=redis_prefix + "readyz:") as running:
        first = httpx.get(running.base_url + "/readyz", timeout=10).json()
        assert first["status"] == "ready"
        assert "no Celery worker answered" in first["notes"]["uploads"]
        running.services.db_engine.dispose()
        original = running.services.db_engine.url
        from sqlalchemy import create_engine

        running.services.db_engine = create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
        try:
            broken = httpx.get(running.base_url + "/readyz", timeout=10)
        finally:
            running.services.db_engine = create_engine(original)
        assert broken.status_code == 503 and set(broken.json()["not_ready"]) == {"database"}
