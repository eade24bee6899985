"""Server-Sent Events framing shared by both endpoints, and the response that streams it.

Per streamed token the API server does little more than this module: the
fields every chunk of a request repeats are serialised once (`ChunkEncoder`),
the common chunk (text only) is a byte template around the one encoded
string, and all the events one engine output makes go to the client in one
write (`EventStreamResponse` sends what the body yields; the body yields one
bytes object per output). The client parses the same events, in the same
order, as if each had been written alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from loraplex.platform.errors import error_body
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_encode = msgspec.json.Encoder().encode
_TEXT_TAIL = b',"logprobs":null,"finish_reason":null}]}\n\n'


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


class ChunkEncoder:
    """SSE bytes of one request's chunks; the fields every chunk repeats are serialised once."""

    def __init__(self, base: dict[str, Any]) -> None:
        head = _encode(base)
        self._prefix = b"data: " + head[:-1] + (b',"choices":' if base else b'"choices":')
        self._content_heads: dict[int, bytes] = {}
        self._text_heads: dict[int, bytes] = {}

    def encode(self, choices: list[dict[str, Any]]) -> bytes:
        return self._prefix + _encode(choices) + b"}\n\n"

    def content(self, index: int, text: str) -> bytes:
        """A chat chunk whose delta is only `content` (no logprobs, not finished): the common one."""
        head = self._content_heads.get(index)
        if head is None:
            head = self._content_heads[index] = self._prefix + b'[{"index":%d,"delta":{"content":' % index
        return head + _encode(text) + b"}" + _TEXT_TAIL

    def text(self, index: int, text: str) -> bytes:
        """A completion chunk with only `text` (no logprobs, not finished): the common one."""
        head = self._text_heads.get(index)
        if head is None:
            head = self._text_heads[index] = self._prefix + b'[{"index":%d,"text":' % index
        return head + _encode(text) + _TEXT_TAIL


def sse_error(status: int, message: str, *, code: str | None = None) -> bytes:
    """A failure after the 200 header went out: OpenAI's SDK raises on an `error` event."""
    return sse(error_body(status, message, code=code))


class EventStreamResponse(Response):
    """Sends each bytes object the body yields as one body message; closes the body however the response ends,
    so its `finally` (abort, metering) runs at once on a client disconnect.

    Pure ASGI, unlike Starlette's StreamingResponse (an AnyIO task group per response, its sends made from a
    child task): one task per response waits for the client's disconnect and, if it comes first, cancels the
    stream's scope. An AnyIO scope, not `Task.cancel`: the generation's close is shielded (metering must
    finish), and only AnyIO's cancellation waits for a shield to end.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes]) -> None:
        self.body_iterator = content
        self.status_code = 200
        self.background = None
        self.init_headers(SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cancel_scope = anyio.CancelScope()
        done = False

        async def wait_for_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not done:
                cancel_scope.cancel()

        listener = asyncio.get_running_loop().create_task(wait_for_disconnect())
        body = self.body_iterator
        try:
            with cancel_scope:  # a cancellation of this scope ends here: the client left, nothing more to say
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for data in body:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                done = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            done = True
            listener.cancel()
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(RuntimeError):  # still running (a cancelled send inside it)
                    await aclose()
