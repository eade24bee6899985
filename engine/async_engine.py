"""AsyncEngine: the engine loop in a thread of this process; the in-process `EngineClient`.

Callers on any asyncio loop submit requests; the engine thread applies
commands (add / abort / finish / release_session) between steps and pushes
each request's token outputs back onto the caller's loop (one wake-up per loop
per step, however many streams), where `OutputStream` makes their text and
matches stop strings, as an API server does for the engine-core process.
Input is validated before anything is queued, so bad input raises at once
and never hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from loraplex.engine.config import EngineConfig, ModelConfig
from loraplex.engine.core.client import AdapterLimits, EngineHealth, read_until_finished
from loraplex.engine.errors import DuplicateRequestError, EngineDeadError
from loraplex.engine.interfaces import AdapterSource
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.output.text import OutputStream
from loraplex.engine.protocol import EngineRequest, RequestOutput

logger = logging.getLogger(__name__)

_STOP = object()
_MAX_ABANDONED = 4096  # abandoned streams nobody collects are forgotten beyond this


class _Stream:
    """Delivers one request's outputs from the engine thread to its asyncio loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, output: OutputStream) -> None:
        self.loop = loop
        self.output = output

    def put(self, item: RequestOutput | BaseException) -> None:
        _post(self.loop, [(self.output, item)])


def _post(loop: asyncio.AbstractEventLoop, items: list[tuple[OutputStream, Any]]) -> None:
    """Hand `items` to their streams on `loop` with ONE thread-safe wake-up (not one per item)."""
    # RuntimeError: the caller's loop is closed; nobody is listening.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[OutputStream, Any]]) -> None:
    for stream, item in items:
        if isinstance(item, BaseException):
            stream.fail(item)
        else:
            stream.deliver(item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, num_threads: int | None = None) -> None:
        self.engine = engine
        engine.detokenize = False  # each caller's loop makes its own text (OutputStream)
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.max_model_len = engine.max_model_len
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._abandoned: OrderedDict[str, _Stream] = OrderedDict()  # stopped early; tail kept for billing
        self._lock = threading.Lock()
        self._stats: dict[str, int] = engine.stats()
        self._dead: BaseException | None = None
        self._num_threads = num_threads
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._thread.start()

    # ---- constructors ---------------------------------------------------------------------
    @classmethod
    def from_model_path(cls, path: str | Path, config: EngineConfig | None = None, **kwargs: Any) -> AsyncEngine:
        return cls(LLMEngine.from_model_path(path, config or EngineConfig(), **kwargs))

    @classmethod
    def from_random(
        cls, model_config: ModelConfig, config: EngineConfig, tokenizer: Any, seed: int = 0, **kwargs: Any
    ) -> AsyncEngine:
        return cls(LLMEngine.from_random(model_config, config, tokenizer, seed, **kwargs))

    # ---- public API -----------------------------------------------------------------------
    async def generate(self, request: EngineRequest, *, whole: bool = False) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (deltas); the last one has `finished=True`. `whole`: the caller
        reads only the finished output, so the steps are held and handed over merged (`OutputStream`).

        Raises a typed `EngineError` before queueing anything if the input is bad.
        Stopping the iteration early (or cancelling it) aborts the request.
        """
        if self._dead is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine loop has stopped: {self._dead or 'shut down'}")
        self.engine.validate(request)
        stream = _Stream(asyncio.get_running_loop(), OutputStream(request, self.tokenizer, whole=whole))
        with self._lock:
            if request.request_id in self._streams:
                raise DuplicateRequestError(
                    f"request id {request.request_id!r} is already running", param="request_id"
                )
            self._streams[request.request_id] = stream
        self._send("add", request)
        finished = False
        try:
            while not finished:
                item = await stream.output.next()
                finished = item.finished
                if stream.output.text.stopped_early:  # a stop string matched here: the engine still runs it
                    with self._lock:
                        self._streams.pop(request.request_id, None)
                    self._send("finish", (request.request_id, stream.output.text.kept_token_counts()))
                yield item
        finally:
            if not finished:
                with self._lock:
                    self._abandoned[request.request_id] = stream
                    while len(self._abandoned) > _MAX_ABANDONED:
                        self._abandoned.popitem(last=False)
                self.abort(request.request_id)

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

    def abort(self, request_id: str) -> None:
        """Free every block of the request at the next loop turn (immediately if idle)."""
        self._send("abort", request_id)

    def release_session(self, key: str) -> None:
        self._send("release_session", key)

    async def session_state(self, key: str) -> str:
        """pinned / offloaded / dropped (a read across threads: a hint, exact once the loop is idle)."""
        return self.engine.session_state(key)

    # ---- adapters -------------------------------------------------------------------------
    def attach_adapters(self, source: AdapterSource, limits: AdapterLimits) -> Any:
        """Serve adapters from `source`, replacing any earlier source (tests attach one per app to a shared
        engine); returns the engine's new LoRA manager, the handle for `detach_adapters`."""
        return self.engine.serve_adapters(source, limits)

    def detach_adapters(self, handle: Any) -> None:
        """Stop `handle`'s loading (a no-op on the engine if a later attach replaced it)."""
        self.engine.stop_serving_adapters(handle)

    def adapter_in_use(self, adapter_id: str) -> bool:
        lora = self.engine.lora
        return lora is not None and lora.is_in_use(adapter_id)

    def evict_adapter(self, adapter_id: str) -> None:
        lora = self.engine.lora
        if lora is not None:
            lora.evict(adapter_id)

    def stats(self) -> dict[str, int]:
        """A snapshot taken by the engine thread after its latest step."""
        return dict(self._stats)

    def shutdown(self) -> None:
        """Abort every running request (their streams end with `abort`) and stop the loop."""
        self._commands.put(("stop", None))
        self._wakeup.set()
        self._thread.join(timeout=30)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def health(self) -> EngineHealth:
        if self._dead is not None:
            return EngineHealth(False, f"the engine loop died: {self._dead}", os.getpid())
        if not self._thread.is_alive():
            return EngineHealth(False, "the engine loop has stopped", os.getpid())
        return EngineHealth(True, pid=os.getpid())

    # ---- the engine thread ----------------------------------------------------------------
    def _send(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        self._wakeup.set()

    def _run(self) -> None:
        if self._num_threads:
            torch.set_num_threads(self._num_threads)
        try:
            while True:
                if not self._apply_commands():
                    return
                if not self.engine.has_unfinished_requests():
                    self._stats = self.engine.stats()
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                self._stats = self.engine.stats()
                if self.engine.last_step_was_idle:  # don't spin while e.g. an adapter loads
                    self._wakeup.wait(0.005)
                    self._wakeup.clear()
                self._deliver(*outputs)
        except BaseException as exc:  # the loop itself broke: fail every caller, never hang them
            logger.exception("engine loop died")
            self._dead = exc
            with self._lock:
                streams = list(self._streams.values())
                self._streams.clear()
            for stream in streams:
                stream.put(EngineDeadError(f"the engine loop has stopped: {exc}"))

    def _apply_commands(self) -> bool:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return True
            if kind == "stop":  # shutting down: end every open stream with `abort`, never leave one hanging
                aborted = [self.engine.abort(request_id) for request_id in list(self.engine.requests)]
                self._deliver(*(out for out in aborted if out is not None))
                return False
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                out = self.engine.abort(payload)
                if out is not None:
                    self._deliver(out)
            elif kind == "finish":  # its caller has all it needs (a stop string): nobody reads the rest
                self.engine.stop(*payload)
            elif kind == "release_session":
                self.engine.release_session(payload)

    def _add(self, request: EngineRequest) -> None:
        try:
            self.engine.add_request(request)
        except Exception as exc:
            with self._lock:
                stream = self._streams.pop(request.request_id, None)
            if stream is not None:
                stream.put(exc)

    def _deliver(self, *outputs: RequestOutput) -> None:
        """Post a step's outputs: one `call_soon_threadsafe` per caller loop, however many streams.

        Per-loop batching keeps a step with many concurrent streams from waking the loop (and
        taking the GIL from the HTTP server) once per stream; order per request is kept because
        each loop runs its batches in the order they were posted.
        """
        batches: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, Any]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
                if stream is not None:
                    batches.setdefault(stream.loop, []).append((stream.output, out))
        for loop, items in batches.items():
            _post(loop, items)
