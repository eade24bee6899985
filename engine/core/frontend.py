"""EngineFrontend: the one `EngineClient`, whatever carries its messages to the engine core.

generate / abort / stop strings / abandoned tails / queries / adapter changes
are written here once; a transport carries the messages: the in-process one
(`local_transport.py`: the core in a thread, what `AsyncEngine` is) or the
ZeroMQ one (`zmq_client_transport.py`: the engine-core process, what
`MultiProcessEngineClient` is).

Callers on any asyncio loop submit requests. Each request's token outputs
are posted to its caller's loop (one wake-up per loop per message, however
many streams), where `OutputStream` makes their text and matches stop
strings; a stop string that ends a request stops it in the core. When the
core dies, every open stream ends with `EngineDeadError` (a 503) and every
later call fails the same way, so nothing waits on a dead core.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from typing import Any, Protocol

from loraplex.engine.config import AdapterLimits, ModelConfig
from loraplex.engine.core.client import EngineHealth, read_until_finished
from loraplex.engine.core.messages import (
    Abort,
    AdapterInUse,
    AdapterInUseQuery,
    CallFailed,
    DetachAdapters,
    EvictAdapter,
    Outputs,
    ReleaseSession,
    Reply,
    SessionState,
    SessionStateQuery,
    Stats,
    error_of,
)
from loraplex.engine.errors import DuplicateRequestError, EngineDeadError
from loraplex.engine.interfaces import AdapterSource
from loraplex.engine.output.text import OutputStream
from loraplex.engine.protocol import EngineRequest, RequestOutput

logger = logging.getLogger(__name__)

_MAX_ABANDONED = 4096  # abandoned streams nobody collects are forgotten beyond this
_CALL_TIMEOUT_S = 30.0


class ClientTransport(Protocol):
    """What differs between the in-process client and the multi-process one."""

    pid: int                          # the process the engine steps in
    initial_stats: dict[str, Any]

    def start(self, receive: Callable[[Any], None], on_dead: Callable[[str], None]) -> None:
        """Begin: the core's messages go to `receive`; `on_dead(reason)` once the core is gone."""

    def send(self, message: Any) -> None:
        """Thread-safe."""

    def add_message(self, request: EngineRequest) -> Any: ...

    def attach_message(self, call_id: int, handle: int, source: AdapterSource, limits: AdapterLimits) -> Any: ...

    def validate(self, request: EngineRequest) -> None: ...

    def dead_reason(self) -> str | None: ...

    def health(self) -> EngineHealth: ...

    def close(self) -> None: ...


class _Stream:
    """One request's outputs, read on the loop that asked for them."""

    __slots__ = ("loop", "output", "started")

    def __init__(self, loop: asyncio.AbstractEventLoop, output: OutputStream) -> None:
        self.loop = loop
        self.output = output
        self.started = False  # an output was handed over already (its next ones are not a first token)


class EngineFrontend:
    def __init__(self, transport: ClientTransport, *, tokenizer: Any, model_config: ModelConfig,
                 max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self._transport = transport
        self._streams: dict[str, _Stream] = {}
        self._abandoned: OrderedDict[str, _Stream] = OrderedDict()  # stopped early; tail kept for billing
        self._calls: dict[int, Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._handles = itertools.count(1)
        self._lock = threading.Lock()
        self._stats: dict[str, Any] = dict(transport.initial_stats)
        transport.start(self._receive, self._fail_all)

    # ---- requests -------------------------------------------------------------------------
    async def generate(self, request: EngineRequest, *, whole: bool = False) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's outputs (deltas); the last one has `finished=True`. `whole`: the caller
        reads only the finished output, so the steps are held and handed over merged (`OutputStream`).

        Raises a typed `EngineError` before queueing anything if the input is bad.
        Stopping the iteration early (or cancelling it) aborts the request.
        """
        self._check_alive()
        self._transport.validate(request)
        message = self._transport.add_message(request)
        request_id = request.request_id
        stream = _Stream(asyncio.get_running_loop(), OutputStream(
            request, self.tokenizer, whole=whole, on_stop=lambda: self._stopped_by_text(request_id, stream)))
        with self._lock:
            if request_id in self._streams:
                raise DuplicateRequestError(f"request id {request_id!r} is already running", param="request_id")
            self._streams[request_id] = stream
        self._transport.send(message)
        finished = False
        try:
            while not finished:
                item = await stream.output.next()
                finished = item.finished
                yield item
        finally:
            if not finished and self._stop_reading(request_id, stream):
                self.abort(request_id)

    def _stopped_by_text(self, request_id: str, stream: _Stream) -> None:
        """A stop string ended the request as its output was handed over (on its caller's loop), while the core
        still runs it: stop it there now, whether or not the caller has read that far, with the tokens each
        choice kept (those past the stop string are neither delivered nor billed)."""
        with self._lock:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
        self._transport.send(Abort([request_id], stop=True, kept_tokens=stream.output.text.kept_token_counts()))

    def _stop_reading(self, request_id: str, stream: _Stream) -> bool:
        """Keep a stream its caller left for `take_abandoned_outputs`; True if the core still runs it (abort it).

        A stream a stop string ended at hand-over is kept too while its caller has not read that far: the core
        was stopped then, and its unread outputs hold the counts billing owes."""
        with self._lock:
            running = self._streams.get(request_id) is stream
            stopped_unread = stream.output.text.stopped_early and not stream.output.finished
            if not running and not stopped_unread:
                return False
            self._abandoned[request_id] = stream
            while len(self._abandoned) > _MAX_ABANDONED:
                self._abandoned.popitem(last=False)
            return running

    def abort(self, request_id: str) -> None:
        """Free every block of the request at the core's next loop turn."""
        self._transport.send(Abort([request_id]))

    async def take_abandoned_outputs(self, request_id: str, timeout_s: float = 10.0) -> list[RequestOutput]:
        """The outputs a generate() stopped early never read, through the final one (cumulative counts).

        Whoever stopped reading (a client went away) still owes the request's final token counts
        to billing; they arrive after the abort. Empty if the request ended normally.
        """
        with self._lock:
            stream = self._abandoned.pop(request_id, None)
        if stream is None:
            return []
        return await read_until_finished(stream.output, timeout_s)

    # ---- sessions and adapters ------------------------------------------------------------
    def release_session(self, key: str) -> None:
        self._transport.send(ReleaseSession(key))

    async def session_state(self, key: str) -> str:
        """pinned / offloaded / dropped."""
        future = self._call(lambda call_id: SessionStateQuery(call_id, key))
        reply: SessionState = await asyncio.wait_for(asyncio.wrap_future(future), _CALL_TIMEOUT_S)
        return reply.state

    def attach_adapters(self, source: AdapterSource, limits: AdapterLimits) -> int:
        """Serve adapters from `source` from now on, replacing the engine's earlier source (tests attach one per
        app to a shared engine). Returns the handle for `detach_adapters`. Never blocks: the core applies it
        before anything this client sends later; a failure is logged."""
        handle = next(self._handles)
        future = self._call(lambda call_id: self._transport.attach_message(call_id, handle, source, limits))
        future.add_done_callback(_log_failed_attach)
        return handle

    def detach_adapters(self, handle: Any) -> None:
        """Stop serving what `handle` attached (nothing, if a later attach replaced it)."""
        self._transport.send(DetachAdapters(handle))

    def adapter_in_use(self, adapter_id: str) -> bool:
        """Blocking (never on the event loop of a multi-process client: its replies are read there)."""
        reply: AdapterInUse = self._wait(self._call(lambda call_id: AdapterInUseQuery(call_id, adapter_id)))
        return reply.in_use

    def evict_adapter(self, adapter_id: str) -> None:
        """Blocking, as adapter_in_use."""
        self._wait(self._call(lambda call_id: EvictAdapter(call_id, adapter_id)))

    # ---- state ----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The core's counters after its latest step (a snapshot; never blocks)."""
        return dict(self._stats)

    def health(self) -> EngineHealth:
        return self._transport.health()

    def shutdown(self) -> None:
        """Stop this client: the in-process core aborts what runs and stops; a multi-process client lets go of
        its socket (its core is stopped by whoever started it)."""
        self._transport.close()
        self._fail_all(self._transport.dead_reason() or "shut down")

    # ---- plumbing -------------------------------------------------------------------------
    def _check_alive(self) -> None:
        reason = self._transport.dead_reason()
        if reason is not None:
            raise EngineDeadError(reason)

    def _call(self, message_for: Callable[[int], Any]) -> Future[Any]:
        """Send a query; its reply (or the core's death) completes the future."""
        self._check_alive()
        call_id = next(self._call_ids)
        message = message_for(call_id)
        future: Future[Any] = Future()
        with self._lock:
            self._calls[call_id] = future
        self._transport.send(message)
        return future

    def _wait(self, future: Future[Any]) -> Any:
        try:
            return future.result(timeout=_CALL_TIMEOUT_S)
        finally:
            future.cancel()  # timed out: its late reply finds nobody

    def _receive(self, message: Any) -> None:
        """A message from the core (on the transport's thread)."""
        if isinstance(message, Outputs):
            if message.stats is not None:
                self._stats = message.stats
            self._dispatch(message)
        elif isinstance(message, Stats):
            self._stats = message.stats
        elif isinstance(message, Reply):
            with self._lock:
                future = self._calls.pop(message.call_id, None)
            if future is None or not future.set_running_or_notify_cancel():
                return
            if isinstance(message, CallFailed):
                future.set_exception(RuntimeError(message.error))
            else:
                future.set_result(message)

    def _dispatch(self, message: Outputs) -> None:
        """Hand a step's outputs to their streams, first tokens first: each stream's reader wakes in the order
        its items are handed over and writes its chunk, so a request's first token handed over after the ~15
        tokens of another tenant's streams on the same API server waited for their ~1 ms of writes."""
        first: list[tuple[_Stream, RequestOutput | BaseException]] = []
        items: list[tuple[_Stream, RequestOutput | BaseException]] = []
        with self._lock:
            for output in message.outputs:
                stream = self._streams.get(output.request_id)
                if output.finished:
                    self._streams.pop(output.request_id, None)
                if stream is not None:
                    (items if stream.started else first).append((stream, output))
                    stream.started = True
            for item in message.failures:
                stream = self._streams.pop(item.request_id, None)
                if stream is not None:
                    items.append((stream, error_of(item)))
        _hand_over(first + items)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            calls = list(self._calls.values())
            self._calls.clear()
        _hand_over([(stream, EngineDeadError(reason)) for stream in streams])
        for future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(reason))


def _hand_over(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    """Give each stream its items on its own loop: directly when already there, else ONE thread-safe wake-up
    per loop (not one per stream: a step with many streams would otherwise wake the loop, and take the GIL
    from the HTTP server, once per stream). Each loop runs its batches in the order they were posted."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, Any]]] = {}
    for stream, item in items:
        batches.setdefault(stream.loop, []).append((stream.output, item))
    try:
        current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        current = None
    for loop, batch in batches.items():
        if loop is current:
            _put_all(batch)
        else:
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening
                loop.call_soon_threadsafe(_put_all, batch)


def _put_all(items: list[tuple[OutputStream, Any]]) -> None:
    for stream, item in items:
        if isinstance(item, BaseException):
            stream.fail(item)
        else:
            stream.deliver(item)


def _log_failed_attach(future: Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error("attaching an adapter source in the engine core failed: %s", future.exception())
