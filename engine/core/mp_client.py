"""MultiProcessEngineClient: the EngineClient of an API server whose engine runs in the engine-core process.

One DEALER socket, used only on this process's event loop (calls from other
threads are posted to it). A reader task hands each `Outputs` message (token
ids) to the streams it names; each stream makes its text and matches stop
strings here (`OutputStream`), off the core's loop, and a stop string that
ends a request stops it in the core. A watcher checks that the core process still exists, and the
moment it does not, every open stream ends with `EngineDeadError` (a 503) and
every later call fails the same way, so nothing waits on a dead core.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import zmq
import zmq.asyncio
from loraplex.engine.config import ModelConfig
from loraplex.engine.core.client import AdapterLimits, EngineHealth, read_until_finished
from loraplex.engine.core.messages import (
    Abort,
    Add,
    Call,
    Codec,
    Hello,
    Outputs,
    Ping,
    Ready,
    ReleaseSession,
    Reply,
    Shutdown,
    Stats,
    error_of,
    to_wire,
)
from loraplex.engine.errors import DuplicateRequestError, EngineDeadError
from loraplex.engine.interfaces import AdapterSource, GrammarCodec
from loraplex.engine.output.text import OutputStream
from loraplex.engine.protocol import EngineRequest, RequestOutput

logger = logging.getLogger(__name__)

_MAX_ABANDONED = 4096
_WATCH_INTERVAL_S = 0.2
_PING_INTERVAL_S = 1.0  # well inside the core's client timeout


def process_exists(pid: int) -> bool:
    """True while `pid` runs (a zombie, killed but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def handshake(address: str, timeout_s: float, still_starting: Callable[[], bool] | None = None, *,
              secret: str = "") -> Ready:
    """Wait until the core at `address` answers (blocking; before the event loop serves anything).

    `still_starting`, checked every 100 ms, ends the wait early with EngineDeadError when it returns False
    (the core's process has exited: waiting out the timeout would only delay the error). `secret`: the one
    the core was started with (a core that has one ignores clients without it).
    """
    codec = Codec()
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    deadline = time.monotonic() + timeout_s
    try:
        socket.send(codec.encode(Hello(secret)))
        while time.monotonic() < deadline:
            if socket.poll(100):
                message = codec.to_client.decode(socket.recv())
                if isinstance(message, Ready):
                    return message
            elif still_starting is not None and not still_starting():
                raise EngineDeadError(f"the engine core at {address} exited before it answered")
        raise EngineDeadError(f"the engine core at {address} did not answer within {timeout_s:.0f} s")
    finally:
        socket.close()


class MultiProcessEngineClient:
    def __init__(self, address: str, *, tokenizer: Any, model_config: ModelConfig, ready: Ready,
                 grammar_codec: GrammarCodec | None = None, secret: str = "") -> None:
        self.address = address
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = ready.max_model_len
        self.core_pid = ready.pid
        self.grammar_codec = grammar_codec
        self._codec = Codec()
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()  # built on the loop it serves
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._streams: dict[str, OutputStream] = {}
        self._abandoned: OrderedDict[str, OutputStream] = OrderedDict()
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._next_call = 0
        self._stats: dict[str, Any] = {}
        self._dead: str | None = None
        self._closed = False
        self._send(Hello(secret))  # so the core trusts us, and heartbeats to us before our first request
        self._tasks = [self._loop.create_task(self._read()), self._loop.create_task(self._watch())]

    @classmethod
    async def connect(cls, address: str, *, tokenizer: Any, model_config: ModelConfig,
                      grammar_codec: GrammarCodec | None = None, timeout_s: float = 60.0,
                      secret: str = "") -> MultiProcessEngineClient:
        ready = await asyncio.to_thread(partial(handshake, address, timeout_s, secret=secret))
        return cls(address, tokenizer=tokenizer, model_config=model_config, ready=ready, grammar_codec=grammar_codec,
                   secret=secret)

    # ---- requests -------------------------------------------------------------------------
    async def generate(self, request: EngineRequest, *, whole: bool = False) -> AsyncIterator[RequestOutput]:
        self._check_alive()
        if request.request_id in self._streams:
            raise DuplicateRequestError(f"request id {request.request_id!r} is already running", param="request_id")
        grammar = None
        if request.grammar is not None:
            if self.grammar_codec is None:
                raise EngineDeadError("this API server has no grammar codec for the engine core")
            grammar = self.grammar_codec.encode(request.grammar)
        stream = OutputStream(request, self.tokenizer, whole=whole)
        self._streams[request.request_id] = stream
        self._send(Add(to_wire(request, grammar)))
        finished = False
        try:
            while not finished:
                item = await stream.next()
                finished = item.finished
                if stream.text.stopped_early:  # a stop string matched here: the core still runs it
                    self._streams.pop(request.request_id, None)
                    self._post(Abort([request.request_id], stop=True, kept_tokens=stream.text.kept_token_counts()))
                yield item
        finally:
            if not finished and request.request_id in self._streams:
                self._abandoned[request.request_id] = stream
                while len(self._abandoned) > _MAX_ABANDONED:
                    self._abandoned.popitem(last=False)
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        self._post(Abort([request_id]))

    async def take_abandoned_outputs(self, request_id: str, timeout_s: float = 10.0) -> list[RequestOutput]:
        stream = self._abandoned.pop(request_id, None)
        if stream is None:
            return []
        return await read_until_finished(stream, timeout_s)

    # ---- sessions and adapters ------------------------------------------------------------
    def release_session(self, key: str) -> None:
        self._post(ReleaseSession(key))

    async def session_state(self, key: str) -> str:
        return str(await self._call("session_state", key))

    def attach_adapters(self, source: AdapterSource, limits: AdapterLimits) -> None:
        """The engine-core process built its own adapter source at start-up; nothing to attach here."""

    def detach_adapters(self, handle: Any) -> None:
        """See attach_adapters."""

    def adapter_in_use(self, adapter_id: str) -> bool:
        return bool(self._call_blocking("adapter_in_use", adapter_id))

    def evict_adapter(self, adapter_id: str) -> None:
        self._call_blocking("evict_adapter", adapter_id)

    # ---- state ----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def health(self) -> EngineHealth:
        if self._dead is not None:
            return EngineHealth(False, self._dead, self.core_pid)
        if self._closed:
            return EngineHealth(False, "this API server is shutting down", self.core_pid)
        return EngineHealth(True, pid=self.core_pid)

    def shutdown(self) -> None:
        """Stop this client (the core is stopped by whoever started it: `stop_core` there)."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        self._fail_all("this API server is shutting down")
        self._socket.close(linger=0)
        self._context.term()

    def stop_core(self) -> None:
        """Ask the core to abort everything and exit (the supervisor's job; tests use it too)."""
        self._post(Shutdown())

    # ---- plumbing -------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._closed:
            raise EngineDeadError("this API server is shutting down")

    def _send(self, message: Any) -> None:
        self._socket.send(self._codec.encode(message))

    def _post(self, message: Any) -> None:
        """Send from any thread: the socket is only ever touched on the event loop."""
        if self._closed or self._dead is not None:
            return
        if threading.get_ident() == self._loop_thread:
            self._send(message)
        else:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody to send for
                self._loop.call_soon_threadsafe(self._send, message)

    async def _call(self, method: str, arg: str) -> Any:
        self._check_alive()
        self._next_call += 1
        call_id = self._next_call
        future: asyncio.Future[Any] = self._loop.create_future()
        self._calls[call_id] = future
        self._send(Call(call_id, method, arg))
        try:
            return await asyncio.wait_for(future, 30.0)
        finally:
            self._calls.pop(call_id, None)

    def _call_blocking(self, method: str, arg: str) -> Any:
        """For worker threads (never the event loop's own thread)."""
        return asyncio.run_coroutine_threadsafe(self._call(method, arg), self._loop).result(timeout=35.0)

    async def _read(self) -> None:
        while True:
            payload = await self._socket.recv()
            try:
                message = self._codec.to_client.decode(payload)
            except Exception:
                logger.exception("dropping a malformed message from the engine core")
                continue
            if isinstance(message, Outputs):
                self._dispatch(message)
            elif isinstance(message, Stats):
                self._stats = message.stats
            elif isinstance(message, Reply):
                future = self._calls.get(message.call_id)
                if future is not None and not future.done():
                    if message.error is None:
                        future.set_result(message.value)
                    else:
                        future.set_exception(RuntimeError(message.error))

    def _dispatch(self, message: Outputs) -> None:
        if message.stats is not None:
            self._stats = message.stats
        for output in message.outputs:
            stream = self._streams.get(output.request_id)
            if output.finished:
                self._streams.pop(output.request_id, None)
            if stream is not None:
                stream.deliver(output)
        for item in message.failures:
            stream = self._streams.pop(item.request_id, None)
            if stream is not None:
                stream.fail(error_of(item))

    async def _watch(self) -> None:
        last_ping = 0.0
        while process_exists(self.core_pid):
            if self._loop.time() - last_ping > _PING_INTERVAL_S:
                self._send(Ping())
                last_ping = self._loop.time()
            await asyncio.sleep(_WATCH_INTERVAL_S)
        self._dead = f"the engine core process (pid {self.core_pid}) has died"
        logger.error("%s; failing %d open requests", self._dead, len(self._streams))
        self._fail_all(self._dead)

    def _fail_all(self, reason: str) -> None:
        for stream in self._streams.values():
            stream.fail(EngineDeadError(reason))
        self._streams.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
