"""An API server's side of the ZeroMQ transport to the engine-core process.

One DEALER socket, used only on this process's event loop (sends from other
threads are posted to it). A reader task hands each decoded message to the
client. A watcher checks that the core process still exists, and the moment
it does not, tells the client, so nothing waits on a dead core; it also pings
the core, which aborts the requests of a client gone silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from loraplex.engine.config import AdapterLimits
from loraplex.engine.core.client import EngineHealth
from loraplex.engine.core.messages import Add, AttachAdapters, Codec, Hello, Ping, Ready, to_wire
from loraplex.engine.errors import EngineDeadError
from loraplex.engine.interfaces import AdapterSource, AdapterSourceCodec, GrammarCodec
from loraplex.engine.protocol import EngineRequest

logger = logging.getLogger(__name__)

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
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
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


class ZmqClientTransport:
    def __init__(self, address: str, ready: Ready, *, grammar_codec: GrammarCodec | None = None,
                 adapter_codec: AdapterSourceCodec | None = None, secret: str = "") -> None:
        """Build it on the event loop it will serve."""
        self.address = address
        self.pid = ready.pid
        self.grammar_codec = grammar_codec
        self.adapter_codec = adapter_codec
        self.initial_stats: dict[str, Any] = {}  # the core's first `Stats` answers our hello
        self._secret = secret
        self._codec = Codec()
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._tasks: list[asyncio.Task[None]] = []
        self._dead: str | None = None
        self._closed = False

    def start(self, receive: Callable[[Any], None], on_dead: Callable[[str], None]) -> None:
        self._send(Hello(self._secret))  # so the core trusts us, and heartbeats to us before our first request
        self._tasks = [self._loop.create_task(self._read(receive)), self._loop.create_task(self._watch(on_dead))]

    def send(self, message: Any) -> None:
        """From any thread: the socket is only ever touched on the event loop."""
        if self._closed or self._dead is not None:
            return
        if threading.get_ident() == self._loop_thread:
            self._send(message)
        else:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody to send for
                self._loop.call_soon_threadsafe(self._send, message)

    def add_message(self, request: EngineRequest) -> Add:
        grammar = None
        if request.grammar is not None:
            if self.grammar_codec is None:
                raise EngineDeadError("this API server has no grammar codec for the engine core")
            grammar = self.grammar_codec.encode(request.grammar)
        return Add(to_wire(request, grammar))

    def attach_message(self, call_id: int, handle: int, source: AdapterSource, limits: AdapterLimits
                       ) -> AttachAdapters:
        if self.adapter_codec is None:
            raise ValueError("this client has no adapter source codec: the engine core cannot open its adapters")
        return AttachAdapters(call_id, handle, self.adapter_codec.encode(source), limits)

    def validate(self, request: EngineRequest) -> None:
        """The core validates as it adds the request; its refusal ends the stream with the typed error."""

    def dead_reason(self) -> str | None:
        if self._dead is not None:
            return self._dead
        if self._closed:
            return "this API server is shutting down"
        return None

    def health(self) -> EngineHealth:
        reason = self.dead_reason()
        return EngineHealth(reason is None, reason, self.pid)

    def close(self) -> None:
        """Stop this side (the core is stopped by whoever started it)."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        self._socket.close(linger=0)
        self._context.term()

    def _send(self, message: Any) -> None:
        self._socket.send(self._codec.encode(message))

    async def _read(self, receive: Callable[[Any], None]) -> None:
        while True:
            payload = await self._socket.recv()
            try:
                message = self._codec.to_client.decode(payload)
            except Exception:
                logger.exception("dropping a malformed message from the engine core")
                continue
            receive(message)

    async def _watch(self, on_dead: Callable[[str], None]) -> None:
        last_ping = 0.0
        while process_exists(self.pid):
            if self._loop.time() - last_ping > _PING_INTERVAL_S:
                self._send(Ping())
                last_ping = self._loop.time()
            await asyncio.sleep(_WATCH_INTERVAL_S)
        self._dead = f"the engine core process (pid {self.pid}) has died"
        logger.error("%s; failing its open requests", self._dead)
        on_dead(self._dead)
