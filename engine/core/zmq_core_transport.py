"""The engine core's side of the ZeroMQ transport: one ROUTER socket that API servers' DEALER sockets connect to.

Each message from a client carries its identity, which is how the core knows
where a request's outputs go. A core given a secret hears a client only once
it has said hello with that secret (the API servers of its own `serve`):
before that, nothing the client sends is acted on or answered.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

import zmq
from loraplex.engine.core.messages import Codec, Hello

logger = logging.getLogger(__name__)


class ZmqCoreTransport:
    def __init__(self, address: str, *, secret: str = "") -> None:
        self.address = address
        self.secret = secret  # "": every client is trusted (the socket's folder is the only guard)
        self.num_untrusted_messages = 0
        self._trusted: set[bytes] = set()
        self._codec = Codec()
        self._context: zmq.Context[Any] | None = None
        self._socket: zmq.Socket[Any] | None = None

    def open(self) -> None:
        """Bind (on the thread that runs the core: a ZeroMQ socket belongs to one thread)."""
        self._context = zmq.Context()
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.SNDHWM, 0)  # never drop an output for a slow reader: it is a client's own memory
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(self.address)
        self._socket = socket

    def receive(self, timeout_s: float) -> list[tuple[bytes, Any]]:
        """Every message waiting (from trusted clients), after waiting up to `timeout_s` for the first."""
        socket = self._require_socket()
        if not socket.poll(int(timeout_s * 1000)):
            return []
        messages: list[tuple[bytes, Any]] = []
        while True:
            try:
                identity, payload = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            try:
                message = self._codec.to_core.decode(payload)
            except Exception:
                logger.exception("dropping a malformed message")
                continue
            if self._is_trusted(identity, message):
                messages.append((identity, message))

    def send(self, client: bytes, message: Any) -> None:
        try:
            self._require_socket().send_multipart([client, self._codec.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError:
            logger.warning("could not reach a client; dropping one message")

    def forget(self, client: bytes) -> None:
        """A client gone silent must say hello again to be heard."""
        self._trusted.discard(client)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=1000)
        if self._context is not None:
            self._context.term()

    def _require_socket(self) -> zmq.Socket[Any]:
        if self._socket is None:
            raise RuntimeError("the transport is not open")
        return self._socket

    def _is_trusted(self, identity: bytes, message: Any) -> bool:
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
