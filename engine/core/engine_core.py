"""The engine-core loop: owns an LLMEngine and a ZeroMQ ROUTER socket, steps without waiting on anyone.

API servers connect DEALER sockets; each message from one carries its
identity, which is how the core knows where a request's outputs go. Between
steps the core drains its socket without blocking; when it has nothing to
run it blocks on the socket (up to the heartbeat interval). Each step's
outputs (token ids: the API servers make the text) leave as ONE `Outputs`
message per client. A core given a secret acts only on clients that said
hello with it (the API servers of its own `serve`). A request's grammar is
rebuilt from its text in a small thread pool, never on the loop (a cache miss
compiles), each tenant under its own cap and in turn with the others; the
request joins the engine when its grammar is ready. A `Stats` message to every
known client, a few times a second, is both the counters and the heartbeat.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections import defaultdict
from concurrent.futures import Future
from typing import Any

import zmq
from loraplex.engine.core.compile_queue import TenantCompileQueue
from loraplex.engine.core.messages import (
    Abort,
    Add,
    Call,
    Codec,
    Failure,
    Hello,
    Outputs,
    Ping,
    Ready,
    ReleaseSession,
    Reply,
    Shutdown,
    Stats,
    WireRequest,
    failure,
    from_wire,
)
from loraplex.engine.errors import DuplicateRequestError
from loraplex.engine.interfaces import CompiledGrammar, GrammarCodec
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.protocol import RequestOutput

logger = logging.getLogger(__name__)

_COMPILE_POLL_MS = 2  # how soon an idle core notices a grammar finished compiling


class EngineCore:
    def __init__(self, engine: LLMEngine, address: str, *, grammar_codec: GrammarCodec | None = None,
                 heartbeat_s: float = 0.25, client_timeout_s: float = 30.0, secret: str = "",
                 compiles_per_tenant: int = 1) -> None:
        self.engine = engine
        self.secret = secret  # "": every client is trusted (the socket's folder is the only guard)
        self._trusted: set[bytes] = set()
        self.num_untrusted_messages = 0
        engine.detokenize = False  # the API servers make the text (engine.output.text)
        self.address = address
        self.grammar_codec = grammar_codec
        self.heartbeat_s = heartbeat_s
        self.client_timeout_s = client_timeout_s
        self._codec = Codec()
        self._owner: dict[str, bytes] = {}     # request id -> the identity of the client that added it
        self._clients: dict[bytes, float] = {}  # identity -> when it was last heard from
        self._pending: dict[bytes, tuple[list[RequestOutput], list[Failure]]] = defaultdict(lambda: ([], []))
        self._last_stats = 0.0
        self._running = True
        # request id -> (client, request, its grammar being rebuilt off the loop)
        self._compiling: dict[str, tuple[bytes, WireRequest, Future[CompiledGrammar]]] = {}
        # One tenant's slow compiles never hold both threads, and tenants take turns (compile_queue.py)
        self._compile_queue = TenantCompileQueue(num_workers=2, max_per_tenant=compiles_per_tenant)

    def run(self) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.SNDHWM, 0)  # never drop an output for a slow reader: it is a client's own memory
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(self.address)
        self._socket = socket
        logger.info("engine core %d listening on %s", os.getpid(), self.address)
        try:
            while self._running:
                busy = self.engine.has_unfinished_requests()
                idle_ms = _COMPILE_POLL_MS if self._compiling else int(self.heartbeat_s * 1000)
                self._receive(timeout_ms=0 if busy else idle_ms)
                self._admit_compiled()
                if self._running and self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                    if self.engine.last_step_was_idle:  # adapters loading: don't spin
                        self._receive(timeout_ms=5)
                self._flush()
                self._heartbeat()
        finally:
            self._compile_queue.shutdown()
            socket.close(linger=1000)
            context.term()

    # ---- input ----------------------------------------------------------------------------
    def _receive(self, timeout_ms: int) -> None:
        if not self._socket.poll(timeout_ms):
            return
        while self._running:
            try:
                identity, payload = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = self._codec.to_core.decode(payload)
            except Exception:
                logger.exception("dropping a malformed message")
                continue
            if not self._is_trusted(identity, message):
                continue
            self._clients[identity] = time.monotonic()
            self._apply(identity, message)

    def _is_trusted(self, identity: bytes, message: Any) -> bool:
        """A client is heard once it has said hello with the core's secret; before that, nothing it sends is
        acted on or answered (shutdown, aborts, requests for any tenant)."""
        if not self.secret or identity in self._trusted:
            return True
        if isinstance(message, Hello) and hmac.compare_digest(message.secret.encode(), self.secret.encode()):
            self._trusted.add(identity)
            return True
        self.num_untrusted_messages += 1
        if self.num_untrusted_messages in (1, 10, 100) or not self.num_untrusted_messages % 1000:
            logger.warning("ignored %d message(s) from clients that have not presented the core's secret",
                           self.num_untrusted_messages)
        return False

    def _apply(self, identity: bytes, message: Any) -> None:
        if isinstance(message, Add):
            self._add(identity, message)
        elif isinstance(message, Abort):
            for request_id in message.request_ids:
                if request_id in self._compiling:
                    self._drop_compiling(request_id)
                    continue
                output = (self.engine.stop(request_id, message.kept_tokens) if message.stop
                          else self.engine.abort(request_id))
                if output is not None:
                    self._deliver([output])
        elif isinstance(message, ReleaseSession):
            self.engine.release_session(message.key)
        elif isinstance(message, Call):
            self._send(identity, self._call(message))
        elif isinstance(message, Ping):
            pass  # being heard from is the point
        elif isinstance(message, Hello):
            self._send(identity, Ready(os.getpid(), self.engine.max_model_len, self.engine.num_blocks))
            self._send(identity, Stats(self._stats()))
        elif isinstance(message, Shutdown):
            for request_id in list(self._compiling):
                self._drop_compiling(request_id)
            for request_id in list(self.engine.requests):
                output = self.engine.abort(request_id)
                if output is not None:
                    self._deliver([output])
            self._running = False

    def _add(self, identity: bytes, message: Add) -> None:
        wire = message.request
        if wire.grammar is None:
            self._admit(identity, wire, None)
        elif wire.request_id in self._compiling:
            self._pending[identity][1].append(failure(wire.request_id, DuplicateRequestError(
                f"request id {wire.request_id!r} is already running", param="request_id")))
        elif self.grammar_codec is None:
            self._pending[identity][1].append(failure(wire.request_id, ValueError("this engine core serves no grammars")))
        else:
            future = self._compile_queue.submit(wire.request_id, wire.tenant_id, self.grammar_codec.decode,
                                                wire.grammar, wire.reasoning)
            self._compiling[wire.request_id] = (identity, wire, future)

    def _admit(self, identity: bytes, wire: WireRequest, grammar: CompiledGrammar | None) -> None:
        try:
            self.engine.add_request(from_wire(wire, grammar))
        except Exception as exc:
            self._pending[identity][1].append(failure(wire.request_id, exc))
            return
        self._owner[wire.request_id] = identity

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready join the engine (in arrival order); a failed compile fails its request."""
        for request_id, (identity, wire, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                grammar = future.result()
            except Exception as exc:
                self._pending[identity][1].append(failure(request_id, exc))
                continue
            self._admit(identity, wire, grammar)

    def _drop_compiling(self, request_id: str) -> None:
        """Aborted before its grammar was ready: it ends with an empty final output, as any abort does."""
        identity, wire, _ = self._compiling.pop(request_id)
        self._compile_queue.cancel(request_id)
        self._pending[identity][0].append(RequestOutput(request_id, [], True, len(wire.prompt_token_ids), 0))

    def _call(self, call: Call) -> Reply:
        try:
            if call.method == "session_state":
                return Reply(call.call_id, self.engine.session_state(call.arg))
            if call.method == "adapter_in_use":
                lora = self.engine.lora
                return Reply(call.call_id, lora is not None and lora.is_in_use(call.arg))
            if call.method == "evict_adapter":
                if self.engine.lora is not None:
                    self.engine.lora.evict(call.arg)
                return Reply(call.call_id, None)
            return Reply(call.call_id, None, f"unknown method {call.method!r}")
        except Exception as exc:
            logger.exception("call %s failed", call.method)
            return Reply(call.call_id, None, f"{type(exc).__name__}: {exc}")

    # ---- output ---------------------------------------------------------------------------
    def _stats(self) -> dict[str, Any]:
        """The engine's counters and the adapters its requests run and wait on (gateways route by them)."""
        scheduler = self.engine.scheduler
        return {**self.engine.stats(),
                "running_adapter_ids": sorted({a for a in scheduler.running_adapter_ids() if a}),
                "waiting_adapter_ids": sorted({a for a in scheduler.queued_adapter_ids() if a})}

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            identity = self._owner.get(output.request_id)
            if output.finished:
                self._owner.pop(output.request_id, None)
            if identity is not None:
                self._pending[identity][0].append(output)

    def _flush(self) -> None:
        if not self._pending:
            return
        stats = self._stats()
        for identity, (outputs, failures) in self._pending.items():
            if outputs or failures:
                self._send(identity, Outputs(outputs, failures, stats))
        self._pending.clear()

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < self.heartbeat_s:
            return
        self._last_stats = now
        self._receive(timeout_ms=0)  # pings that arrived during a long step count: only silence is forgotten
        message = Stats(self._stats())
        for identity, last_seen in list(self._clients.items()):
            if now - last_seen > self.client_timeout_s:
                self._forget(identity)
            else:
                self._send(identity, message)

    def _forget(self, identity: bytes) -> None:
        """A client gone silent: abort what it asked for (nobody will read it) and stop sending to it."""
        del self._clients[identity]
        self._trusted.discard(identity)
        orphans = [request_id for request_id, owner in self._owner.items() if owner == identity]
        if orphans:
            logger.warning("a client went silent; aborting its %d requests", len(orphans))
        for request_id in orphans:
            output = self.engine.abort(request_id)
            if output is not None:
                self._deliver([output])  # a client that was only slow still learns its request ended
        self._flush()

    def _send(self, identity: bytes, message: Any) -> None:
        try:
            self._socket.send_multipart([identity, self._codec.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError:
            logger.warning("could not reach a client; dropping one message")
