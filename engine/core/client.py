"""EngineClient: everything the API layer may ask of the engine, wherever the engine runs.

One implementation, `EngineFrontend` (frontend.py), over two transports:
`AsyncEngine` (the engine core in a thread of this process; tests and
single-process tools) and `MultiProcessEngineClient` (the engine-core process,
over ZeroMQ; what `loraplex serve` uses). The platform types `Services.engine`
with this protocol and calls nothing else.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from loraplex.engine.config import AdapterLimits, ModelConfig
from loraplex.engine.interfaces import AdapterSource
from loraplex.engine.output.text import OutputStream
from loraplex.engine.protocol import EngineRequest, RequestOutput


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """Liveness: the engine loop is running and will answer; `reason` says why not."""

    alive: bool
    reason: str | None = None
    pid: int | None = None       # the process the engine steps in


class EngineClient(Protocol):
    tokenizer: Any
    model_config: ModelConfig
    max_model_len: int

    def generate(self, request: EngineRequest, *, whole: bool = False) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs (deltas), the last with `finished=True`; a typed EngineError before
        anything is queued for bad input. Stopping early (or cancelling) aborts the request. `whole`: the
        caller reads only the finished output (a non-streaming response): the steps' outputs may come as
        one, merged, with `received_at` set to when the first of them arrived."""

    def abort(self, request_id: str) -> None:
        """Free the request's KV blocks at the engine's next step."""

    async def take_abandoned_outputs(self, request_id: str, timeout_s: float = 10.0) -> list[RequestOutput]:
        """Outputs an aborted generate() never read, through the final one (billing needs the counts)."""

    def release_session(self, key: str) -> None:
        """Unpin a session's KV blocks (safe from any thread)."""

    async def session_state(self, key: str) -> str:
        """Where a session's KV is: pinned / offloaded / dropped."""

    def attach_adapters(self, source: AdapterSource, limits: AdapterLimits) -> Any:
        """Serve adapters from `source` (replacing the engine's earlier source); returns a handle for
        `detach_adapters`. Through the engine-core process the source crosses as its `AdapterSourceCodec` text."""

    def detach_adapters(self, handle: Any) -> None: ...

    def adapter_in_use(self, adapter_id: str) -> bool:
        """Blocking (call it off the event loop): does a queued or running request use the adapter?"""

    def evict_adapter(self, adapter_id: str) -> None:
        """Drop the adapter from the engine's slots and host cache (after its deletion)."""

    def stats(self) -> dict[str, Any]:
        """The engine's counters after its latest step (a snapshot; never blocks)."""

    def health(self) -> EngineHealth: ...

    def shutdown(self) -> None:
        """Abort what runs and stop the engine (what this client started)."""


async def read_until_finished(stream: OutputStream, timeout_s: float) -> list[RequestOutput]:
    """A stopped stream's remaining outputs, through its final one (or what came within `timeout_s`):
    billing still needs the final counts of a request whose client went away."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    outputs: list[RequestOutput] = []
    while not stream.finished:
        try:
            outputs.append(await asyncio.wait_for(stream.next(), max(deadline - loop.time(), 0.0)))
        except TimeoutError:
            return outputs
        except Exception:  # the engine side failed the request: nothing more will come
            return outputs
    return outputs
