"""Ports and in-thread servers for tests: one home for helpers every test folder uses.

A plain module rather than conftest.py, because test modules cannot import from conftest reliably:
each test folder has its own conftest.py, and whichever pytest loaded last is the `conftest` module.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from waiting import wait_until


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it; a race with other processes is possible but rare)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serve_in_thread(app: Any, port: int, *, send_buffer_bytes: int | None = None,
                    unread_timeout_s: float = 0.0) -> Iterator[str]:
    """uvicorn in a background thread with its own event loop; yields the base URL once it accepts.

    The listening socket is the one `loraplex serve` binds (`bind_socket`), so `unread_timeout_s` (the server's
    `stream_send_timeout_s`) closes connections whose client stops reading, as in production.
    `send_buffer_bytes` fixes the kernel send buffer of every connection (accepted sockets inherit it from the
    listener). Over loopback Linux grows a socket's send buffer up to 4 MB, so a response of a few hundred KB never
    makes a send wait however little the client reads; a client on a real network holds far less in flight.
    """
    import uvicorn
    from loraplex.platform.supervisor import bind_socket

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    listener = bind_socket("127.0.0.1", port, unread_timeout_s=unread_timeout_s)
    if send_buffer_bytes is not None:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sockets = [listener]
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, name=f"uvicorn-{port}", daemon=True)
    thread.start()

    def started() -> bool:
        if not thread.is_alive():
            raise RuntimeError(f"uvicorn on port {port} stopped before it started")
        return server.started

    wait_until(started, timeout_s=120, what=f"uvicorn on port {port} to start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        listener.close()
