"""The one edge middleware, served by uvicorn: body limits, request ids, response metrics, slow readers."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from local_serving import free_port, serve_in_thread
from loraplex.platform.api.sse import EventStreamResponse
from loraplex.platform.body_limit import BodyLimits
from loraplex.platform.edge import EdgeMiddleware
from loraplex.platform.metrics import Metrics
from waiting import wait_until

LIMIT = 4096
SEND_TIMEOUT_S = 0.5


def served(app: FastAPI) -> Any:
    return serve_in_thread(app, free_port())


class StreamLog:
    def __init__(self) -> None:
        self.num_chunks = 0
        self.closed = threading.Event()


@pytest.fixture(scope="module")
def edge_server() -> Iterator[tuple[str, Metrics, dict[str, StreamLog]]]:
    app = FastAPI()
    metrics = Metrics()
    streams: dict[str, StreamLog] = {}

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, Any]:
        return {"num_bytes": len(await request.body())}

    @app.get("/stream/{name}")
    async def stream(name: str, chunks: int = 1_000_000, size: int = 64 * 1024) -> EventStreamResponse:
        log = streams[name] = StreamLog()

        async def body() -> AsyncIterator[bytes]:
            try:
                for _ in range(chunks):
                    log.num_chunks += 1
                    yield b"data: " + b"x" * size + b"\n\n"
                    await asyncio.sleep(0)
            finally:
                log.closed.set()

        return EventStreamResponse(body())

    app.add_middleware(EdgeMiddleware, limits=BodyLimits(max_body_bytes=LIMIT, max_upload_bytes=LIMIT),
                       metrics=metrics, send_timeout_s=SEND_TIMEOUT_S)
    with served(app) as base_url:
        yield base_url, metrics, streams


def _count(metrics: Metrics, route: str, status: int) -> float:
    value = metrics.registry.get_sample_value("loraplex_http_requests_total", {"route": route, "status": str(status)})
    return value or 0.0


def _settled_count(metrics: Metrics, route: str, status: int, expected: float) -> float:
    """The count once it reaches `expected` (or after 10 s): a request is counted as its response ends, which the
    server may finish a moment after the client has read the reply (a refused body's 413 above all)."""
    wait_until(lambda: _count(metrics, route, status) >= expected, timeout_s=10,
               what=lambda: f"{route} {status} counted {expected:g} times, not {_count(metrics, route, status):g}",
               ignoring=())
    return _count(metrics, route, status)


def test_each_response_has_its_own_request_id_and_is_counted_by_route(edge_server) -> None:
    base_url, metrics, _ = edge_server
    before = _count(metrics, "/echo", 200)
    ids = set()
    for _ in range(3):
        reply = httpx.post(base_url + "/echo", content=b"x" * 100)
        assert reply.status_code == 200 and reply.json() == {"num_bytes": 100}
        ids.add(reply.headers["x-request-id"])
    assert len(ids) == 3 and all(i.startswith("req_") for i in ids)
    assert _settled_count(metrics, "/echo", 200, before + 3) == before + 3


def test_a_declared_body_over_the_limit_is_413_before_it_is_read(edge_server) -> None:
    base_url, metrics, _ = edge_server
    before = _count(metrics, "unmatched", 413)
    reply = httpx.post(base_url + "/echo", content=b"x" * (LIMIT + 1))
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    assert reply.headers["x-request-id"].startswith("req_")
    assert _settled_count(metrics, "unmatched", 413, before + 1) == before + 1


def test_a_chunked_body_is_cut_off_as_it_passes_the_limit(edge_server) -> None:
    base_url, metrics, _ = edge_server
    before = _count(metrics, "/echo", 413)

    def body() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(8):
            yield b"x" * 1024

    reply = httpx.post(base_url + "/echo", content=body())
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    assert reply.headers["x-request-id"].startswith("req_")
    assert _settled_count(metrics, "/echo", 413, before + 1) == before + 1
    assert httpx.post(base_url + "/echo", content=b"x" * LIMIT).status_code == 200  # at the limit: served


def test_api_paths_without_a_key_are_401_at_the_edge(edge_server) -> None:
    base_url, metrics, _ = edge_server
    before = _count(metrics, "unmatched", 401)
    reply = httpx.post(base_url + "/v1/chat/completions", json={})
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "missing_api_key"
    assert reply.headers["www-authenticate"] == "Bearer" and reply.headers["x-request-id"].startswith("req_")
    assert _settled_count(metrics, "unmatched", 401, before + 1) == before + 1


def test_a_stream_nobody_reads_is_cut_and_its_body_closed(edge_server) -> None:
    base_url, metrics, streams = edge_server
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    try:
        sock.sendall(b"GET /stream/unread HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_until(lambda: "unread" in streams, timeout_s=10, interval_s=0.01, what="the stream to start")
        assert streams["unread"].closed.wait(10), "the unread stream is still open"
        stalled_at = streams["unread"].num_chunks
        time.sleep(2 * SEND_TIMEOUT_S)
        assert streams["unread"].num_chunks == stalled_at  # nothing more was generated for it
    finally:
        sock.close()
    assert _count(metrics, "/stream/{name}", 200) >= 1


def test_a_stream_that_is_read_outlives_the_send_timeout(edge_server) -> None:
    base_url, _, streams = edge_server
    started = time.monotonic()
    num_events = 0
    with httpx.stream("GET", base_url + "/stream/read", params={"chunks": 200, "size": 64}, timeout=30) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                num_events += 1
                time.sleep(0.01)  # a slow but steady reader: 2 s in all, four send timeouts
    assert num_events == 200 and time.monotonic() - started > 4 * SEND_TIMEOUT_S
    assert streams["read"].closed.is_set()
