"""Server-Sent Events framing shared by both endpoints."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from loraplex.platform.errors import error_body
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class ChunkEncoder:
    """SSE bytes of one chunk; the fields every chunk of a request repeats are serialised once."""

    def __init__(self, base: dict[str, Any]) -> None:
        head = json.dumps(base, separators=(",", ":"), ensure_ascii=False)
        self._prefix = b"data: " + head[:-1].encode() + (b',"choices":' if base else b'"choices":')

    def encode(self, choices: list[dict[str, Any]]) -> bytes:
        return self._prefix + json.dumps(choices, separators=(",", ":"), ensure_ascii=False).encode() + b"}\n\n"


def sse_error(status: int, message: str, *, code: str | None = None) -> bytes:
    """A failure after the 200 header went out: OpenAI's SDK raises on an `error` event."""
    return sse(error_body(status, message, code=code))


class EventStreamResponse(StreamingResponse):
    """Closes its generator however the response ends, so the generator's `finally` (abort, metering)
    runs at once on a client disconnect instead of whenever the garbage collector gets to it."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, headers=SSE_HEADERS)
        self._generator = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._generator, "aclose", None)
            if aclose is not None:
                await aclose()
