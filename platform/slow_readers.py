"""Streams whose client stopped reading are ended, so their engine slot and KV blocks come back.

A client that opens a stream and never reads it fills the socket buffers;
from then on every body chunk waits in `send` while the engine keeps
generating into memory for it. Past `Settings.stream_send_timeout_s` without
a chunk being taken, the send fails: the response ends, its generator closes
(aborting the engine request and metering what was produced) and the
connection is dropped.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)


class SlowReaderError(Exception):
    """The client has not taken a chunk of its stream within the send timeout."""


class SlowReaderMiddleware:
    def __init__(self, app: ASGIApp, *, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.timeout_s:
            await self.app(scope, receive, send)
            return

        async def send_within_timeout(message: Message) -> None:
            if message["type"] != "http.response.body" or not message.get("more_body"):
                await send(message)
                return
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for wraps every chunk's send in a new task.
                async with asyncio.timeout(self.timeout_s):
                    await send(message)
            except TimeoutError:
                log.warning("ending a stream whose client read nothing for %.0f s", self.timeout_s)
                raise SlowReaderError(f"the client read nothing for {self.timeout_s} s") from None

        try:
            await self.app(scope, receive, send_within_timeout)
        except SlowReaderError:
            return  # the response has started: nothing more can be said to this client; uvicorn drops it
