"""MultiProcessEngineClient: the EngineClient of an API server whose engine runs in the engine-core process.

It is the one client front end (`frontend.py`) over the ZeroMQ transport
(`zmq_client_transport.py`), built on the event loop it serves.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import TYPE_CHECKING, Any

from loraplex.engine.core.frontend import EngineFrontend
from loraplex.engine.core.messages import Ready, Shutdown
from loraplex.engine.core.zmq_client_transport import ZmqClientTransport, handshake, process_exists
from loraplex.engine.interfaces import AdapterSourceCodec, GrammarCodec

if TYPE_CHECKING:  # the engine's config imports torch, which a supervisor or API server need not load for this
    from loraplex.engine.config import ModelConfig

__all__ = ["MultiProcessEngineClient", "handshake", "process_exists"]


class MultiProcessEngineClient(EngineFrontend):
    def __init__(self, address: str, *, tokenizer: Any, model_config: ModelConfig, ready: Ready,
                 grammar_codec: GrammarCodec | None = None, adapter_codec: AdapterSourceCodec | None = None,
                 secret: str = "") -> None:
        """`adapter_codec`: how `attach_adapters` writes a source for the core (None: this client attaches none;
        a core can be started serving its own)."""
        transport = ZmqClientTransport(address, ready, grammar_codec=grammar_codec, adapter_codec=adapter_codec,
                                       secret=secret)
        super().__init__(transport, tokenizer=tokenizer, model_config=model_config,
                         max_model_len=ready.max_model_len)
        self.address = address
        self.core_pid = ready.pid

    @classmethod
    async def connect(cls, address: str, *, tokenizer: Any, model_config: ModelConfig,
                      grammar_codec: GrammarCodec | None = None, adapter_codec: AdapterSourceCodec | None = None,
                      timeout_s: float = 60.0, secret: str = "") -> MultiProcessEngineClient:
        ready = await asyncio.to_thread(partial(handshake, address, timeout_s, secret=secret))
        return cls(address, tokenizer=tokenizer, model_config=model_config, ready=ready, grammar_codec=grammar_codec,
                   adapter_codec=adapter_codec, secret=secret)

    def stop_core(self) -> None:
        """Ask the core to abort everything and exit (the supervisor's job; tests use it too)."""
        self._transport.send(Shutdown())
