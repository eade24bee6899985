"""The engine-core loop: owns an LLMEngine, applies its clients' commands between steps, steps without waiting.

One loop, whatever carries the messages: a thread of this process with an
in-process queue (`local_transport.py`, what `AsyncEngine` runs), or its own
process with a ZeroMQ socket (`zmq_core_transport.py`, what `loraplex serve`
runs). Between steps the core takes every waiting message without blocking;
when it has nothing to run it blocks on its transport (up to the heartbeat
interval). Each step's outputs (token ids: the clients make the text) leave
as ONE `Outputs` message per client. A request's grammar that crossed as
text is rebuilt in a small thread pool, never on the loop (a cache miss
compiles), each tenant under its own cap and in turn with the others; the
request joins the engine when its grammar is ready. A `Stats` message to
every known client, a few times a second and whenever the core goes quiet,
is both the counters and the heartbeat.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from loraplex.engine.core.compile_queue import TenantCompileQueue
from loraplex.engine.core.messages import (
    Abort,
    AdapterInUse,
    AdapterInUseQuery,
    Add,
    AttachAdapters,
    CallFailed,
    DetachAdapters,
    Done,
    EvictAdapter,
    Failure,
    Hello,
    LocalAdd,
    LocalAttachAdapters,
    Outputs,
    Ping,
    Ready,
    ReleaseSession,
    SessionState,
    SessionStateQuery,
    Shutdown,
    Stats,
    WireRequest,
    failure,
    from_wire,
)
from loraplex.engine.errors import DuplicateRequestError
from loraplex.engine.interfaces import AdapterSource, AdapterSourceCodec, CompiledGrammar, GrammarCodec
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.protocol import EngineRequest, RequestOutput

logger = logging.getLogger(__name__)

_COMPILE_POLL_S = 0.002  # how soon an idle core notices a grammar finished compiling
_IDLE_STEP_WAIT_S = 0.005  # after a step that could run nothing (adapters loading): don't spin
# A step's outputs carry the counters when a request ends in them (the client sees it counted), else at most this
# often: building and encoding them every step was ~5% of a busy core's loop on a GPU with a 1 ms step.
_STATS_WITH_OUTPUTS_S = 0.05


class CoreTransport(Protocol):
    """How messages reach the core and leave it; `client` names the sender (and where replies go)."""

    def open(self) -> None: ...

    def receive(self, timeout_s: float) -> list[tuple[bytes, Any]]:
        """Every message waiting, after waiting up to `timeout_s` for the first."""

    def send(self, client: bytes, message: Any) -> None: ...

    def forget(self, client: bytes) -> None: ...

    def close(self) -> None: ...


class EngineCore:
    def __init__(self, engine: LLMEngine, transport: CoreTransport, *, grammar_codec: GrammarCodec | None = None,
                 adapter_codec: AdapterSourceCodec | None = None, heartbeat_s: float = 0.25,
                 client_timeout_s: float | None = 30.0, compiles_per_tenant: int = 1) -> None:
        """`client_timeout_s`: a client silent that long (its process died) has its requests aborted;
        None for clients that cannot die apart from the core (the in-process one)."""
        if engine.detokenize:
            raise ValueError("the engine core sends token ids and its clients make the text: build the "
                             "LLMEngine with detokenize=False")
        self.engine = engine
        self.transport = transport
        self.grammar_codec = grammar_codec
        self.adapter_codec = adapter_codec
        self.heartbeat_s = heartbeat_s
        self.client_timeout_s = client_timeout_s
        self._owner: dict[str, bytes] = {}     # request id -> the client that added it
        self._clients: dict[bytes, float] = {}  # client -> when it was last heard from
        self._pending: dict[bytes, tuple[list[RequestOutput], list[Failure]]] = defaultdict(lambda: ([], []))
        self._attachments: dict[tuple[bytes, int], Any] = {}  # (client, handle) -> the LoRA manager it attached
        self._last_stats = 0.0
        self._stats_sent: dict[bytes, float] = {}  # client -> when its outputs last carried the counters
        self._running = True
        # request id -> (client, request, its grammar being rebuilt off the loop)
        self._compiling: dict[str, tuple[bytes, WireRequest, Future[CompiledGrammar]]] = {}
        # One tenant's slow compiles never hold both threads, and tenants take turns (compile_queue.py)
        self._compile_queue = TenantCompileQueue(num_workers=2, max_per_tenant=compiles_per_tenant)
        self._handlers: dict[type, Callable[[bytes, Any], None]] = {
            Hello: self._on_hello, Ping: self._on_ping, Add: self._on_add, LocalAdd: self._on_local_add,
            Abort: self._on_abort, ReleaseSession: self._on_release_session,
            SessionStateQuery: self._on_session_state, AdapterInUseQuery: self._on_adapter_in_use,
            EvictAdapter: self._on_evict_adapter, AttachAdapters: self._on_attach_adapters,
            LocalAttachAdapters: self._on_attach_adapters, DetachAdapters: self._on_detach_adapters,
            Shutdown: self._on_shutdown,
        }

    def run(self) -> None:
        self.transport.open()
        logger.info("engine core %d running", os.getpid())
        try:
            while self._running:
                busy = self.engine.has_unfinished_requests()
                idle_s = _COMPILE_POLL_S if self._compiling else self.heartbeat_s
                heard = self._receive(0.0 if busy else idle_s)
                self._admit_compiled()
                stepped = self._running and self.engine.has_unfinished_requests()
                if stepped:
                    self._deliver(self.engine.step())
                    if self.engine.last_step_was_idle:
                        heard += self._receive(_IDLE_STEP_WAIT_S)
                self._flush()
                if (heard or stepped) and not self.engine.has_unfinished_requests():
                    self._send_stats()  # gone quiet: a client waiting for the counters at rest sees them now
                self._heartbeat()
        finally:
            self._compile_queue.shutdown()
            self.transport.close()

    def stats(self) -> dict[str, Any]:
        """The engine's counters and the adapters its requests run and wait on (gateways route by them).
        Read on the loop's thread (or before the loop starts)."""
        scheduler = self.engine.scheduler
        return {**self.engine.stats(),
                "running_adapter_ids": sorted({a for a in scheduler.running_adapter_ids() if a}),
                "waiting_adapter_ids": sorted({a for a in scheduler.queued_adapter_ids() if a})}

    # ---- input ----------------------------------------------------------------------------
    def _receive(self, timeout_s: float) -> int:
        """Apply what the clients sent; the number of messages other than pings."""
        num_heard = 0
        for client, message in self.transport.receive(timeout_s):
            if not self._running:
                break
            self._clients[client] = time.monotonic()
            handler = self._handlers.get(type(message))
            if handler is None:
                logger.warning("ignoring a message of unknown type %s", type(message).__name__)
                continue
            handler(client, message)
            num_heard += not isinstance(message, Ping)
        return num_heard

    def _on_hello(self, client: bytes, _message: Hello) -> None:
        self.transport.send(client, Ready(os.getpid(), self.engine.max_model_len, self.engine.num_blocks))
        self.transport.send(client, Stats(self.stats()))

    def _on_ping(self, _client: bytes, _message: Ping) -> None:
        """Being heard from is the point."""

    def _on_add(self, client: bytes, message: Add) -> None:
        wire = message.request
        if wire.grammar is None:
            self._admit(client, from_wire(wire, None))
        elif wire.request_id in self._compiling:
            self._pending[client][1].append(failure(wire.request_id, DuplicateRequestError(
                f"request id {wire.request_id!r} is already running", param="request_id")))
        elif self.grammar_codec is None:
            self._pending[client][1].append(failure(wire.request_id, ValueError("this engine core serves no grammars")))
        else:
            future = self._compile_queue.submit(wire.request_id, wire.tenant_id, self.grammar_codec.decode,
                                                wire.grammar, wire.reasoning)
            self._compiling[wire.request_id] = (client, wire, future)

    def _on_local_add(self, client: bytes, message: LocalAdd) -> None:
        self._admit(client, message.request)

    def _admit(self, client: bytes, request: EngineRequest) -> None:
        try:
            self.engine.add_request(request)
        except Exception as exc:
            self._pending[client][1].append(failure(request.request_id, exc))
            return
        self._owner[request.request_id] = client

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready join the engine (in arrival order); a failed compile fails its request."""
        for request_id, (client, wire, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                grammar = future.result()
            except Exception as exc:
                self._pending[client][1].append(failure(request_id, exc))
                continue
            self._admit(client, from_wire(wire, grammar))

    def _on_abort(self, _client: bytes, message: Abort) -> None:
        for request_id in message.request_ids:
            if request_id in self._compiling:
                self._drop_compiling(request_id)
                continue
            output = (self.engine.stop(request_id, message.kept_tokens) if message.stop
                      else self.engine.abort(request_id))
            if output is not None:
                self._deliver([output])

    def _drop_compiling(self, request_id: str) -> None:
        """Aborted before its grammar was ready: it ends with an empty final output, as any abort does."""
        client, wire, _ = self._compiling.pop(request_id)
        self._compile_queue.cancel(request_id)
        self._pending[client][0].append(RequestOutput(request_id, [], True, len(wire.prompt_token_ids), 0))

    def _on_release_session(self, _client: bytes, message: ReleaseSession) -> None:
        self.engine.release_session(message.key)

    def _on_shutdown(self, _client: bytes, _message: Shutdown) -> None:
        for request_id in list(self._compiling):
            self._drop_compiling(request_id)
        for request_id in list(self.engine.requests):
            output = self.engine.abort(request_id)
            if output is not None:
                self._deliver([output])
        self._running = False

    # ---- queries and adapter changes ------------------------------------------------------
    def _on_session_state(self, client: bytes, query: SessionStateQuery) -> None:
        self._answer(client, query.call_id, lambda: SessionState(query.call_id, self.engine.session_state(query.key)))

    def _on_adapter_in_use(self, client: bytes, query: AdapterInUseQuery) -> None:
        def answer() -> AdapterInUse:
            lora = self.engine.lora
            return AdapterInUse(query.call_id, lora is not None and lora.is_in_use(query.adapter_id))

        self._answer(client, query.call_id, answer)

    def _on_evict_adapter(self, client: bytes, query: EvictAdapter) -> None:
        def evict() -> Done:
            if self.engine.lora is not None:
                self.engine.lora.evict(query.adapter_id)
            return Done(query.call_id)

        self._answer(client, query.call_id, evict)

    def _on_attach_adapters(self, client: bytes, message: AttachAdapters | LocalAttachAdapters) -> None:
        def attach() -> Done:
            source = message.source if isinstance(message, LocalAttachAdapters) else self._decode_source(message.source)
            self._attachments[(client, message.handle)] = self.engine.serve_adapters(source, message.limits)
            return Done(message.call_id)

        self._answer(client, message.call_id, attach)

    def _decode_source(self, text: str) -> AdapterSource:
        if self.adapter_codec is None:
            raise ValueError("this engine core has no adapter source codec: it cannot open a client's adapters")
        return self.adapter_codec.decode(text)

    def _on_detach_adapters(self, client: bytes, message: DetachAdapters) -> None:
        manager = self._attachments.pop((client, message.handle), None)
        if manager is not None:
            self.engine.stop_serving_adapters(manager)

    def _answer(self, client: bytes, call_id: int, reply: Callable[[], Any]) -> None:
        try:
            message = reply()
        except Exception as exc:
            logger.exception("query %d failed", call_id)
            message = CallFailed(call_id, f"{type(exc).__name__}: {exc}")
        self.transport.send(client, message)

    # ---- output ---------------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            client = self._owner.get(output.request_id)
            if output.finished:
                self._owner.pop(output.request_id, None)
            if client is not None:
                self._pending[client][0].append(output)

    def _flush(self) -> None:
        if not self._pending:
            return
        now = time.monotonic()
        stats = None
        for client, (outputs, failures) in self._pending.items():
            if not (outputs or failures):
                continue
            with_stats = (failures or any(output.finished for output in outputs)
                          or now - self._stats_sent.get(client, 0.0) >= _STATS_WITH_OUTPUTS_S)
            if with_stats:
                stats = stats or self.stats()
                self._stats_sent[client] = now
            self.transport.send(client, Outputs(outputs, failures, stats if with_stats else None))
        self._pending.clear()

    def _send_stats(self) -> None:
        message = Stats(self.stats())
        for client in self._clients:
            self.transport.send(client, message)

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < self.heartbeat_s:
            return
        self._last_stats = now
        if self.client_timeout_s is not None:
            self._receive(0.0)  # pings that arrived during a long step count: only silence is forgotten
            for client, last_seen in list(self._clients.items()):
                if now - last_seen > self.client_timeout_s:
                    self._forget(client)
        self._send_stats()

    def _forget(self, client: bytes) -> None:
        """A client gone silent: abort what it asked for (nobody will read it), drop the adapters it attached,
        and stop sending to it."""
        del self._clients[client]
        self._stats_sent.pop(client, None)
        self.transport.forget(client)
        orphans = [request_id for request_id, owner in self._owner.items() if owner == client]
        if orphans:
            logger.warning("a client went silent; aborting its %d requests", len(orphans))
        for request_id in orphans:
            output = self.engine.abort(request_id)
            if output is not None:
                self._deliver([output])  # a client that was only slow still learns its request ended
        for key in [key for key in self._attachments if key[0] == client]:
            self.engine.stop_serving_adapters(self._attachments.pop(key))
        self._flush()
