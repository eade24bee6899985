"""Limits at the edge, before a request's body is read: the API key's presence and form, then the body size.

Why here and not in the routes: FastAPI reads and parses a JSON body before
it runs a route's dependencies, so without this an 80 MB body with no key is
received and parsed (seconds of the event loop, for every tenant) before its
401. This pure ASGI middleware answers at once when the key is missing or
cannot be a key (checking the key against the database stays in the
`CurrentKey` dependency), refuses a declared `Content-Length` over the limit
before reading a byte, and counts the bytes of a streamed (chunked) body as
they arrive, answering 413 the moment they pass the limit. Adapter uploads
(`POST /v1/adapters`) have their own, larger limit.

Given the request limits, a large body of the two generation routes is also
read whole here and its counted lists checked before anything parses it
(platform/api/body_probe.py): a 400 naming the parameter, at a few
milliseconds' cost instead of a full parse on the event loop.
"""

from __future__ import annotations

import json

from loraplex.platform.api.body_probe import PROBE_MIN_BYTES, PROBED_PATHS, probe_counts
from loraplex.platform.api.request_limits import RequestLimits
from loraplex.platform.auth.keys import looks_like_api_key
from loraplex.platform.errors import error_body
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_AUTHENTICATED_PREFIX = "/v1/"
_UPLOAD_PATH = "/v1/adapters"
_MAX_KEY_LENGTH = 256  # our keys are 47 characters; anything far longer cannot be one


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int, max_upload_bytes: int,
                 request_limits: RequestLimits | None = None, max_tools: int = 128) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max_upload_bytes
        self.request_limits = request_limits
        self.max_tools = max_tools

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        headers = {name.lower(): value for name, value in scope.get("headers", [])}
        if path.startswith(_AUTHENTICATED_PREFIX):
            refusal = _key_refusal(headers.get(b"authorization", b""))
            if refusal is not None:
                await _send_error(send, 401, refusal[0], code=refusal[1], headers=[(b"www-authenticate", b"Bearer")])
                return
        limit = self.max_upload_bytes if (path == _UPLOAD_PATH and scope.get("method") == "POST") else self.max_body_bytes
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await _send_too_large(send, limit)
            return
        if self.request_limits is not None and path in PROBED_PATHS and scope.get("method") == "POST":
            await self._probed(scope, receive, send, limit, self.request_limits)
            return
        await _LimitedBody(self.app, limit).run(scope, receive, send)

    async def _probed(self, scope: Scope, receive: Receive, send: Send, limit: int, limits: RequestLimits) -> None:
        """Read the whole body (within `limit`), refuse it if a counted list is too long, else replay it."""
        chunks: list[bytes] = []
        num_received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body was through
            chunk = message.get("body", b"")
            num_received += len(chunk)
            if num_received > limit:
                await _send_too_large(send, limit)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if len(body) >= PROBE_MIN_BYTES:
            refusal = probe_counts(body, limits, max_tools=self.max_tools)
            if refusal is not None:
                await _send_error(send, 400, refusal.message, code=None, param=refusal.param)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # what follows the body: a disconnect, when the client leaves
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class _LimitedBody:
    """One request: counts body bytes as the app reads them; past the limit, answers 413 and cuts it off."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.num_received = 0
        self.refused = False
        self.response_started = False

    async def run(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def limited_receive() -> Message:
            if self.refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                self.num_received += len(message.get("body", b""))
                if self.num_received > self.limit:
                    self.refused = True
                    if not self.response_started:
                        self.response_started = True
                        await _send_too_large(send, self.limit)
                    return {"type": "http.disconnect"}  # the app stops reading as for a client that left
            return message

        async def guarded_send(message: Message) -> None:
            if self.refused:
                return  # the 413 went out already; whatever the app answers to the cut-off body is dropped
            if message["type"] == "http.response.start":
                self.response_started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not self.refused:
                raise


def _key_refusal(header: bytes) -> tuple[str, str] | None:
    """(message, code) when the Authorization header cannot carry a valid key; None when it might."""
    if not header:
        return "missing API key: send it as 'Authorization: Bearer lpx_...'", "missing_api_key"
    scheme, _, token = header.decode("latin-1").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return "malformed Authorization header: expected 'Bearer <API key>'", "invalid_api_key"
    if len(token) > _MAX_KEY_LENGTH or not looks_like_api_key(token):
        return "invalid or revoked API key", "invalid_api_key"
    return None


async def _send_too_large(send: Send, limit: int) -> None:
    await _send_error(send, 413, f"the request body is larger than the limit of {limit} bytes",
                      code="request_too_large")


async def _send_error(send: Send, status: int, message: str, *, code: str | None, param: str | None = None,
                      headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code, param=param)).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"), *(headers or [])],
    })
    await send({"type": "http.response.body", "body": body})
