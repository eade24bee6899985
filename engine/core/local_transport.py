"""The in-process transport: the engine core runs in a thread of this process, and messages cross as objects.

A client's messages go into one queue the core's thread reads (thread-safe,
from any thread: no event loop is needed to send); the core's messages to a
client are handed to the client's `receive` on the core's thread, where the
client posts them to its callers' event loops. Nothing is encoded; a request
crosses with its compiled grammar and an adapter source as the object it is.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
from loraplex.engine.config import AdapterLimits
from loraplex.engine.core.client import EngineHealth
from loraplex.engine.core.engine_core import EngineCore
from loraplex.engine.core.messages import Hello, LocalAdd, LocalAttachAdapters, Shutdown
from loraplex.engine.interfaces import AdapterSource
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.protocol import EngineRequest

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 30.0


class LocalCoreTransport:
    """The core's side: one inbox for every client, and each client's `receive` for what goes back."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[tuple[bytes, Any]] = queue.SimpleQueue()
        self._clients: dict[bytes, Callable[[Any], None]] = {}

    def connect(self, receive: Callable[[Any], None]) -> bytes:
        client = f"local-{len(self._clients)}".encode()
        self._clients[client] = receive
        return client

    def put(self, client: bytes, message: Any) -> None:
        self._inbox.put((client, message))

    def open(self) -> None:
        """Nothing to bind: the queue exists from the start, so messages sent before the loop runs wait in it."""

    def receive(self, timeout_s: float) -> list[tuple[bytes, Any]]:
        messages = []
        try:
            messages.append(self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait())
            while True:
                messages.append(self._inbox.get_nowait())
        except queue.Empty:
            return messages

    def send(self, client: bytes, message: Any) -> None:
        self._clients[client](message)

    def forget(self, client: bytes) -> None:
        """An in-process client is never silent for long: nothing to forget."""

    def close(self) -> None:
        """Nothing to release."""


class LocalClientTransport:
    """The client's side: starts the core's thread over `engine` and talks to it through the queue."""

    def __init__(self, engine: LLMEngine, num_threads: int | None = None) -> None:
        self.engine = engine
        self.pid = os.getpid()
        self._num_threads = num_threads
        self._core_side = LocalCoreTransport()
        # No client timeout: this client lives and dies with the core's process.
        self._core = EngineCore(engine, self._core_side, client_timeout_s=None)
        self.initial_stats = self._core.stats()
        self._client = b""
        self._died: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._on_dead: Callable[[str], None] = lambda _reason: None

    def start(self, receive: Callable[[Any], None], on_dead: Callable[[str], None]) -> None:
        self._client = self._core_side.connect(receive)
        self._on_dead = on_dead
        self.send(Hello())  # so the core counts this client among those it sends its counters to
        self._thread.start()

    def send(self, message: Any) -> None:
        """From any thread."""
        self._core_side.put(self._client, message)

    def add_message(self, request: EngineRequest) -> LocalAdd:
        return LocalAdd(request)

    def attach_message(self, call_id: int, handle: int, source: AdapterSource, limits: AdapterLimits
                       ) -> LocalAttachAdapters:
        return LocalAttachAdapters(call_id, handle, source, limits)

    def validate(self, request: EngineRequest) -> None:
        """Refuse bad input before anything is queued (the engine's limits are at hand here)."""
        self.engine.validate(request)

    def dead_reason(self) -> str | None:
        if self._died is not None:
            return f"the engine loop has stopped: {self._died}"
        if not self._thread.is_alive():
            return "the engine loop has stopped: shut down"
        return None

    def health(self) -> EngineHealth:
        reason = self.dead_reason()
        return EngineHealth(reason is None, reason, self.pid)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """The core aborts every running request (their streams end with `abort`) and its loop ends."""
        self.send(Shutdown())
        self._thread.join(timeout=_JOIN_TIMEOUT_S)

    def _run(self) -> None:
        if self._num_threads:
            torch.set_num_threads(self._num_threads)
        try:
            self._core.run()
        except BaseException as exc:  # the loop itself broke: fail every caller, never hang them
            logger.exception("engine loop died")
            self._died = exc
            self._on_dead(f"the engine loop has stopped: {exc}")
