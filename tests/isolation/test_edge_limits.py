"""Limits at the edge: a missing or malformed key and an oversized body are refused before the body is
read, so a huge request costs the server (and every other tenant) nothing."""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

pytestmark = pytest.mark.timing  # wall-clock bounds: run alone (make test)

BIG = 80 * 1024 * 1024
SMALL_LIMIT = 64 * 1024
UPLOAD_LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def server(start_server):
    with start_server(max_request_body_bytes=SMALL_LIMIT, max_upload_request_bytes=UPLOAD_LIMIT) as running:
        yield running


def auth(server, label: str = "all") -> dict[str, str]:
    return {"Authorization": f"Bearer {server.keys[label]}"}


def json_body(size: int) -> bytes:
    return b'{"model": "x", "prompt": "' + b"a" * size + b'"}'


def test_missing_key_on_an_80mb_body_is_refused_before_reading_it(server):
    sent = []

    def body() -> Iterator[bytes]:
        chunk = b"a" * (1024 * 1024)
        for _ in range(BIG // len(chunk)):
            sent.append(len(chunk))
            yield chunk

    start = time.monotonic()
    with httpx.Client(timeout=30) as client:
        reply = client.post(server.base_url + "/v1/completions", content=body(),
                            headers={"Content-Type": "application/json", "Content-Length": str(BIG)})
    elapsed = time.monotonic() - start
    assert reply.status_code == 401
    assert reply.json()["error"]["code"] == "missing_api_key"
    assert reply.headers["www-authenticate"] == "Bearer"
    assert "x-request-id" in reply.headers
    assert elapsed < 2.0
    assert sum(sent) < BIG  # the server hung up long before the body was through


@pytest.mark.parametrize(("header", "code"), [
    ("Basic abc", "invalid_api_key"),
    ("Bearer not-a-key", "invalid_api_key"),
    ("Bearer lpx_" + "x" * 5000, "invalid_api_key"),
])
def test_malformed_keys_get_401_without_a_database_lookup(server, header, code):
    reply = httpx.post(server.base_url + "/v1/chat/completions", content=json_body(10),
                       headers={"Authorization": header, "Content-Type": "application/json"})
    assert reply.status_code == 401
    assert reply.json()["error"]["code"] == code


def test_declared_length_over_the_limit_is_413_naming_it(server):
    reply = httpx.post(server.base_url + "/v1/completions", content=json_body(SMALL_LIMIT),
                       headers={**auth(server), "Content-Type": "application/json"})
    assert reply.status_code == 413
    error = reply.json()["error"]
    assert str(SMALL_LIMIT) in error["message"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"


def test_streamed_body_is_cut_off_as_it_passes_the_limit(server):
    """No Content-Length (chunked): bytes are counted as they arrive."""
    sent = []

    def body() -> Iterator[bytes]:
        yield b'{"model": "x", "prompt": "'
        for _ in range(4096):
            sent.append(16 * 1024)
            yield b"a" * (16 * 1024)

    with httpx.Client(timeout=30) as client:
        reply = client.post(server.base_url + "/v1/completions", content=body(),
                            headers={**auth(server), "Content-Type": "application/json"})
    assert reply.status_code == 413
    assert str(SMALL_LIMIT) in reply.json()["error"]["message"]
    assert sum(sent) < 4096 * 16 * 1024


def test_a_body_under_the_limit_still_works(server):
    reply = httpx.post(server.base_url + "/v1/completions", headers=auth(server), timeout=60,
                       json={"model": "SmolLM2-135M-Instruct", "prompt": "Hello " * 200, "max_tokens": 1})
    assert reply.status_code == 200, reply.text


def test_adapter_uploads_have_their_own_larger_limit(server):
    files = {"file": ("adapter.zip", b"\0" * (SMALL_LIMIT * 2), "application/zip")}
    within = httpx.post(server.base_url + "/v1/adapters", headers=auth(server), files=files, data={"name": "a1"})
    assert within.status_code != 413 and within.status_code < 500, within.text  # reached the upload parser
    files = {"file": ("adapter.zip", b"\0" * (UPLOAD_LIMIT + 1), "application/zip")}
    over = httpx.post(server.base_url + "/v1/adapters", headers=auth(server), files=files, data={"name": "a2"})
    assert over.status_code == 413
    assert str(UPLOAD_LIMIT) in over.json()["error"]["message"]


def send_raw_80mb_without_key(port: int, done: threading.Event) -> None:
    """A client that sends the whole 80 MB as fast as it can, as the original attack did."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {BIG}\r\n\r\n".encode())
        chunk = b"a" * (1024 * 1024)
        try:
            for _ in range(BIG // len(chunk)):
                sock.sendall(chunk)
        except OSError:
            pass  # the server answered 401 and closed: exactly what we want
    done.set()


def test_another_tenants_requests_are_not_delayed_by_the_80mb_body(server):
    port = int(server.base_url.rsplit(":", 1)[1])
    with httpx.Client(base_url=server.base_url, headers=auth(server, "globex"), timeout=30) as victim:
        def latency() -> float:
            start = time.monotonic()
            assert victim.get("/v1/models").status_code == 200
            return time.monotonic() - start

        quiet = [latency() for _ in range(20)]
        done = threading.Event()
        attackers = [threading.Thread(target=send_raw_80mb_without_key, args=(port, done)) for _ in range(3)]
        for thread in attackers:
            thread.start()
        under_attack = [latency() for _ in range(20)]
        for thread in attackers:
            thread.join(timeout=30)
    assert done.is_set()
    assert max(under_attack) < max(statistics.median(quiet) * 10, 0.25), (quiet, under_attack)
