"""Streams whose client stopped reading are ended, so their engine slot and KV blocks come back.

A client that opens a stream and never reads it fills the socket buffers;
from then on every body chunk waits in `send` while the engine keeps
generating into memory for it. Past `Settings.stream_send_timeout_s` without
a chunk being taken, the send fails: the response ends, its generator closes
(aborting the engine request and metering what was produced) and the
connection is dropped.

Why a sweeper and not a timeout around each send: a timer per streamed chunk
(asyncio.timeout, or wait_for's task) costs more than the rest of the send.
Each stream notes when its pending send began (a float); one task per event
loop looks at the pending sends every `timeout_s / 4` (at most a second) and
cancels the task of any send older than the timeout, which the send turns
into `SlowReaderError`. A send is thus cut between `timeout_s` and
`timeout_s + period` after it began.
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.types import Message, Send

log = logging.getLogger(__name__)


class SlowReaderError(Exception):
    """The client has not taken a chunk of its stream within the send timeout."""


class SendWatch:
    """One response's pending body send: since when (0.0: none), in which task, and whether it was cut."""

    __slots__ = ("expired", "since", "task")

    def __init__(self) -> None:
        self.since = 0.0
        self.task: asyncio.Task | None = None
        self.expired = False


class SlowReaderGuard:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.period_s = min(1.0, max(timeout_s / 4, 0.05))
        self._watches: set[SendWatch] = set()
        self._sweeper: asyncio.Task | None = None

    def watch(self) -> SendWatch:
        watch = SendWatch()
        self._watches.add(watch)
        sweeper = self._sweeper
        if sweeper is None or sweeper.done() or sweeper.get_loop() is not asyncio.get_running_loop():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return watch

    def unwatch(self, watch: SendWatch) -> None:
        self._watches.discard(watch)

    async def send(self, watch: SendWatch, send: Send, message: Message) -> None:
        task = watch.task = asyncio.current_task()
        watch.since = time.monotonic()
        try:
            await send(message)
        except asyncio.CancelledError:
            if not watch.expired:
                raise
            if task is not None:
                task.uncancel()  # the cancellation was ours, and is answered by the error below
            log.warning("ending a stream whose client read nothing for %.0f s", self.timeout_s)
            raise SlowReaderError(f"the client read nothing for {self.timeout_s} s") from None
        finally:
            watch.since = 0.0

    async def _sweep(self) -> None:
        while self._watches:
            await asyncio.sleep(self.period_s)
            deadline = time.monotonic() - self.timeout_s
            for watch in list(self._watches):
                if 0.0 < watch.since < deadline and not watch.expired and watch.task is not None:
                    watch.expired = True
                    watch.task.cancel()
