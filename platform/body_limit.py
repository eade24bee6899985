"""Limits at the edge, before a request's body is read: the API key's presence and form, then the body size.

Why here and not in the routes: FastAPI reads and parses a JSON body before
it runs a route's dependencies, so without this an 80 MB body with no key is
received and parsed (seconds of the event loop, for every tenant) before its
401. The edge answers at once when the key is missing or cannot be a key (checking the key against the database stays in the
`CurrentKey` dependency), refuses a declared `Content-Length` over the limit
before reading a byte, and counts the bytes of a streamed (chunked) body as
they arrive, answering 413 the moment they pass the limit. Adapter uploads
(`POST /v1/adapters`) have their own, larger limit. The checks run in the
one edge middleware (platform/edge.py); this module holds them.

Given the request limits, a large body of the two generation routes is also
read whole here and its counted lists checked before anything parses it
(platform/api/body_probe.py): a 400 naming the parameter, at a few
milliseconds' cost instead of a full parse on the event loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from loraplex.platform.api.body_probe import PROBE_MIN_BYTES, PROBED_PATHS, probe_counts
from loraplex.platform.api.request_limits import RequestLimits
from loraplex.platform.auth.keys import looks_like_api_key
from loraplex.platform.errors import error_body
from starlette.types import Receive, Send

AUTHENTICATED_PREFIX = "/v1/"
UPLOAD_PATHS = ("/v1/adapters", "/v1/files")  # POST bodies under the upload limit; the routes enforce their own
_MAX_KEY_LENGTH = 256  # our keys are 47 characters; anything far longer cannot be one


@dataclass(frozen=True, slots=True)
class BodyLimits:
    max_body_bytes: int
    max_upload_bytes: int
    request_limits: RequestLimits | None = None  # None: generation bodies are not probed
    max_tools: int = 128

    def limit_for(self, path: str, method: str) -> int:
        return self.max_upload_bytes if (path in UPLOAD_PATHS and method == "POST") else self.max_body_bytes

    def probes(self, path: str, method: str) -> bool:
        return self.request_limits is not None and method == "POST" and path in PROBED_PATHS


async def read_probed_body(receive: Receive, send: Send, limits: BodyLimits, limit: int) -> bytes | None:
    """The whole body (within `limit`), or None once refused (413, or 400 for a counted list past its limit)
    or when the client left before its body was through."""
    chunks: list[bytes] = []
    num_received = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        num_received += len(chunk)
        if num_received > limit:
            await send_too_large(send, limit)
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    if len(body) >= PROBE_MIN_BYTES and limits.request_limits is not None:
        refusal = probe_counts(body, limits.request_limits, max_tools=limits.max_tools)
        if refusal is not None:
            await send_error(send, 400, refusal.message, code=None, param=refusal.param)
            return None
    return body


def key_refusal(header: bytes) -> tuple[str, str] | None:
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


async def send_too_large(send: Send, limit: int) -> None:
    await send_error(send, 413, f"the request body is larger than the limit of {limit} bytes",
                     code="request_too_large")


async def send_error(send: Send, status: int, message: str, *, code: str | None, param: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code, param=param)).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"), *(headers or [])],
    })
    await send({"type": "http.response.body", "body": body})


def declared_length(value: str | bytes | None) -> int | None:
    """A `Content-Length` value as a number; None unless it is plain ASCII digits of a sane length (then the body
    is counted as it streams instead). `str.isdigit` alone takes "²", and int() refuses 4,300 digits or more."""
    if not value or len(value) > 18 or not value.isascii() or not value.isdigit():
        return None
    return int(value)
