"""A stream's first output, awaited before the 200 for a while, then with SSE keep-alive comments.

A request that fails at submission should fail with its real HTTP status, so
a stream waits for the engine's first output before answering 200. But a
request queued behind others may wait long, and proxies and clients drop a
connection that stays silent (often after 30-60 s). So the wait before the
200 is bounded (`Settings.sse_keepalive_s`); past it, the response starts and
sends `: keep-alive` comments, which every SSE client ignores, at that
interval until the first output arrives. An error after that point arrives
as an SSE `error` event, as any mid-stream failure does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Generic, TypeVar

from fastapi import Request
from loraplex.platform.api.generation import ClientDisconnected, settle, until_disconnected

T = TypeVar("T")

KEEPALIVE = b": keep-alive\n\n"


class PrimedOutputs(Generic[T]):
    """The outputs of a generation, the first one awaited (maybe still pending) in its own task."""

    def __init__(self, first: asyncio.Future[T], rest: AsyncGenerator[T, None], *, keepalive_s: float) -> None:
        self.first = first
        self.rest = rest
        self.keepalive_s = keepalive_s
        self._items = self._iterate()

    def __aiter__(self) -> PrimedOutputs[T]:
        return self

    async def __anext__(self) -> T:
        return await self._items.__anext__()

    async def _iterate(self) -> AsyncGenerator[T, None]:
        yield await self.first
        async for item in self.rest:
            yield item

    async def keepalives(self) -> AsyncIterator[bytes]:
        """A comment every `keepalive_s` until the first output is there (or has failed)."""
        while not self.first.done():
            done, _ = await asyncio.wait({self.first}, timeout=self.keepalive_s)
            if not done:
                yield KEEPALIVE

    async def aclose(self) -> None:
        if not self.first.done():
            self.first.cancel()  # its engine stream aborts the request on the way out
            await settle([self.first])
        with contextlib.suppress(RuntimeError):  # still running in the cancelled task: it ends itself
            await self._items.aclose()
            await self.rest.aclose()


async def prime_within(request: Request, outputs: AsyncGenerator[T, None], *, keepalive_s: float) -> PrimedOutputs[T]:
    """Wait up to `keepalive_s` (0: without limit) for the first output; raise at once if the submission
    failed (so the error keeps its HTTP status) or the client left (ClientDisconnected)."""
    first = asyncio.ensure_future(anext(outputs))
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({first, watcher}, timeout=keepalive_s or None, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        first.cancel()
        raise
    finally:
        disconnected = watcher.done() and not watcher.cancelled()
        watcher.cancel()
    if first.done():
        first.result()
    elif disconnected:
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        raise ClientDisconnected()
    return PrimedOutputs(first, outputs, keepalive_s=keepalive_s)
