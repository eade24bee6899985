"""The one middleware every request passes: request id, edge limits, response metrics, the slow-reader guard.

Why one and not a layer each: every ASGI middleware wraps `send` once more,
and a streamed response calls `send` for every chunk; four layers (each with
its own closures per request) cost more per chunk than the chunk's own
encoding. This one builds one small object per request (`_Exchange`) whose
`send` does, in one call:

- `http.response.start`: adds `x-request-id` (platform/request_context.py)
  and notes the status, which is counted per route when the request ends
  (platform/metrics.py);
- a body chunk (streamed or whole, the last one too): a send timed by the
  slow-reader guard (platform/slow_readers.py), without a timer per chunk;
- anything after a 413 the edge sent itself: dropped.

Before the app runs, the edge limits of platform/body_limit.py: an API key
that cannot be one is a 401, a body over its limit a 413 (declared, or
counted as it arrives), and a large generation body is probed for counted
lists past their limits. It is pure ASGI: no task per request, nothing
buffered but a probed body. CORS, when configured, stays a separate,
outermost layer (platform/api/cors.py), so a browser's preflight is answered
before the key check.
"""

from __future__ import annotations

from loraplex.platform.body_limit import (
    AUTHENTICATED_PREFIX,
    BodyLimits,
    declared_length,
    key_refusal,
    read_probed_body,
    send_error,
    send_too_large,
)
from loraplex.platform.metrics import Metrics
from loraplex.platform.request_context import REQUEST_ID_HEADER_BYTES, current_request_id, new_request_id
from loraplex.platform.slow_readers import SendWatch, SlowReaderError, SlowReaderGuard
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_DISCONNECT: Message = {"type": "http.disconnect"}


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, *, limits: BodyLimits, metrics: Metrics | None = None,
                 send_timeout_s: float = 0.0) -> None:
        self.app = app
        self.limits = limits
        self.metrics = metrics
        self.guard = SlowReaderGuard(send_timeout_s) if send_timeout_s else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        token = current_request_id.set(request_id)
        state = scope.get("state")
        if state is None:
            state = scope["state"] = {}
        state["request_id"] = request_id
        exchange = _Exchange(send, request_id.encode(), self.guard)
        try:
            await self._handle(scope, receive, exchange)
        except SlowReaderError:
            pass  # the response has started: nothing more can be said to this client; uvicorn drops it
        finally:
            current_request_id.reset(token)
            if exchange.watch is not None:
                self.guard.unwatch(exchange.watch)  # type: ignore[union-attr]
            if self.metrics is not None:
                route = scope.get("route")
                self.metrics.count_response(route.path if route is not None else "unmatched", exchange.status)

    async def _handle(self, scope: Scope, receive: Receive, exchange: _Exchange) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        authorization = content_length = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"content-length":
                content_length = value
        send = exchange.send
        if path.startswith(AUTHENTICATED_PREFIX):
            refusal = key_refusal(authorization)
            if refusal is not None:
                await send_error(send, 401, refusal[0], code=refusal[1], headers=[(b"www-authenticate", b"Bearer")])
                return
        limits = self.limits
        limit = limits.limit_for(path, method)
        declared = declared_length(content_length)
        if declared is not None and declared > limit:
            await send_too_large(send, limit)
            return
        if limits.probes(path, method):
            body = await read_probed_body(receive, send, limits, limit)
            if body is not None:
                await self.app(scope, _Replay(body, receive).receive, send)
            return
        exchange.limit = limit
        exchange.receive_from = receive
        try:
            await self.app(scope, exchange.counted_receive, send)
        except Exception:
            if not exchange.refused:
                raise


class _Replay:
    """A body read whole by the edge, handed to the app as one message; then the client's own messages."""

    __slots__ = ("body", "receive_from")

    def __init__(self, body: bytes, receive_from: Receive) -> None:
        self.body: bytes | None = body
        self.receive_from = receive_from

    async def receive(self) -> Message:
        body = self.body
        if body is None:
            return await self.receive_from()  # what follows the body: a disconnect, when the client leaves
        self.body = None
        return {"type": "http.request", "body": body, "more_body": False}


class _Exchange:
    """One request's side of the edge: its send, its response status, its body count."""

    __slots__ = (
        "_send",
        "guard",
        "limit",
        "num_received",
        "receive_from",
        "refused",
        "request_id",
        "started",
        "status",
        "watch",
    )

    def __init__(self, send: Send, request_id: bytes, guard: SlowReaderGuard | None) -> None:
        self._send = send
        self.request_id = request_id
        self.guard = guard
        self.status = 500  # if the app fails before answering, ServerErrorMiddleware (outside) answers 500
        self.started = False
        self.refused = False
        self.limit = 0
        self.num_received = 0
        self.receive_from: Receive | None = None
        self.watch: SendWatch | None = None

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body":
            if self.refused:
                return  # the 413 went out already; whatever the app answers to the cut-off body is dropped
            if self.guard is not None:  # the last chunk too, and a whole body: a client can leave any of them unread
                watch = self.watch
                if watch is None:
                    watch = self.watch = self.guard.watch()
                await self.guard.send(watch, self._send, message)
                return
            await self._send(message)
            return
        if message["type"] == "http.response.start":
            if self.refused:
                return
            self.started = True
            self.status = message["status"]
            message["headers"] = [*message.get("headers", ()), (REQUEST_ID_HEADER_BYTES, self.request_id)]
        await self._send(message)

    async def counted_receive(self) -> Message:
        """The client's body as the app reads it; past the limit, a 413 (if nothing was answered yet) and, for
        the app, a disconnect: it stops reading as for a client that left."""
        if self.refused:
            return _DISCONNECT
        message = await self.receive_from()  # type: ignore[misc]
        if message["type"] == "http.request":
            self.num_received += len(message.get("body", b""))
            if self.num_received > self.limit:
                if not self.started:
                    await send_too_large(self.send, self.limit)
                self.refused = True
                return _DISCONNECT
        return message
