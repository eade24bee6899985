"""The messages between API servers and the engine-core process, and their msgpack encoding.

Every message is a msgspec Struct (tagged, so one decoder reads the whole
union); the payload types are the engine's own plain dataclasses
(`SamplingParams`, `RequestOutput`...), which msgspec encodes field by field.
Nothing is pickled: a message that does not match its schema is refused
by the decoder. A request's grammar crosses as the text its `GrammarCodec`
wrote (compiled grammars are not plain data), an adapter source as the text
its `AdapterSourceCodec` wrote. Each query is a struct of its own, answered
by a reply of its own type (or `CallFailed`) carrying the query's `call_id`.

The in-process transport passes these same messages as objects, never
encoded; only where a request or an adapter source is not plain data does it
use its own `Local*` message, which carries the object itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from loraplex.engine import errors as engine_errors
from loraplex.engine.config import AdapterLimits
from loraplex.engine.interfaces import AdapterSource
from loraplex.engine.protocol import EngineRequest, ReasoningMarkers, RequestOutput, SamplingParams


class WireRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    tenant_id: str
    adapter_id: str | None
    cache_salt: str
    grammar: str | None        # GrammarCodec.encode's text
    reasoning: ReasoningMarkers | None
    session_id: str | None
    priority: int = 0
    background: bool = False
    tenant_weight: float = 1.0


# ---- API server -> engine core ----------------------------------------------------------------------

class Hello(msgspec.Struct, tag=True):
    """First message of a client; answered with `Ready`. A core started with a secret hears nothing else from a
    client until it has sent one carrying that secret."""

    secret: str = ""


class Add(msgspec.Struct, tag=True):
    request: WireRequest


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]
    stop: bool = False  # a stop string ended them on the client's side: finished as stopped (sessions keep pins)
    kept_tokens: list[int] = []  # with stop, one request: output tokens each choice delivered


class ReleaseSession(msgspec.Struct, tag=True):
    key: str


class SessionStateQuery(msgspec.Struct, tag=True):
    """Where a session's KV is; answered by `SessionState`."""

    call_id: int
    key: str


class AdapterInUseQuery(msgspec.Struct, tag=True):
    """Does a queued or running request use the adapter? Answered by `AdapterInUse`."""

    call_id: int
    adapter_id: str


class EvictAdapter(msgspec.Struct, tag=True):
    """Drop the adapter from the slots and the host cache (it was deleted); answered by `Done`."""

    call_id: int
    adapter_id: str


class AttachAdapters(msgspec.Struct, tag=True):
    """Serve adapters from `source` (an `AdapterSourceCodec`'s text) from now on, replacing the engine's
    earlier source; `handle` (the client's number) names it for `DetachAdapters`. Answered by `Done`."""

    call_id: int
    handle: int
    source: str
    limits: AdapterLimits


class DetachAdapters(msgspec.Struct, tag=True):
    """Stop serving the source attached under `handle` (nothing, if a later attach replaced it)."""

    handle: int


class Ping(msgspec.Struct, tag=True):
    """A client's heartbeat: a client silent for long (its process died) has its requests aborted."""


class Shutdown(msgspec.Struct, tag=True):
    """Abort everything and exit (sent by the process that started the core)."""


ToCore = (Hello | Add | Abort | ReleaseSession | SessionStateQuery | AdapterInUseQuery | EvictAdapter | AttachAdapters
          | DetachAdapters | Ping | Shutdown)


# ---- engine core -> API server ----------------------------------------------------------------------

class Failure(msgspec.Struct, array_like=True):
    """A request the core refused or lost; the client raises it as the engine error it names."""

    request_id: str
    error: str       # an error class name from engine.errors (others become EngineError)
    message: str
    param: str | None


class Ready(msgspec.Struct, tag=True):
    pid: int
    max_model_len: int
    num_blocks: int


class Outputs(msgspec.Struct, tag=True):
    """Everything one engine step produced for one client: one message per step, however many streams.

    `stats` are the counters after that step, so a client that sees a request finish also sees it counted; None
    in most steps' messages where no request ended (at most one a client every 50 ms carries them then).
    """

    outputs: list[RequestOutput]
    failures: list[Failure]
    stats: dict[str, Any] | None = None


class Stats(msgspec.Struct, tag=True):
    """The core's counters; also its heartbeat (sent a few times a second, busy or idle)."""

    stats: dict[str, Any]


class SessionState(msgspec.Struct, tag=True):
    call_id: int
    state: str  # pinned / offloaded / dropped


class AdapterInUse(msgspec.Struct, tag=True):
    call_id: int
    in_use: bool


class Done(msgspec.Struct, tag=True):
    """A query that answers nothing but that it was carried out."""

    call_id: int


class CallFailed(msgspec.Struct, tag=True):
    call_id: int
    error: str


Reply = SessionState | AdapterInUse | Done | CallFailed
ToClient = Ready | Outputs | Stats | SessionState | AdapterInUse | Done | CallFailed


# ---- in-process only (never encoded) ----------------------------------------------------------------

@dataclass(slots=True)
class LocalAdd:
    """`Add` within one process: the request as it is, its grammar compiled already."""

    request: EngineRequest


@dataclass(slots=True)
class LocalAttachAdapters:
    """`AttachAdapters` within one process: the source object itself."""

    call_id: int
    handle: int
    source: AdapterSource
    limits: AdapterLimits


def to_wire(request: EngineRequest, grammar: str | None) -> WireRequest:
    return WireRequest(request.request_id, request.prompt_token_ids, request.sampling, request.tenant_id,
                       request.adapter_id, request.cache_salt, grammar, request.reasoning, request.session_id,
                       request.priority, request.background, request.tenant_weight)


def from_wire(wire: WireRequest, grammar: Any) -> EngineRequest:
    return EngineRequest(request_id=wire.request_id, prompt_token_ids=wire.prompt_token_ids, sampling=wire.sampling,
                         tenant_id=wire.tenant_id, adapter_id=wire.adapter_id, cache_salt=wire.cache_salt,
                         grammar=grammar, reasoning=wire.reasoning, session_id=wire.session_id,
                         priority=wire.priority, background=wire.background, tenant_weight=wire.tenant_weight)


def failure(request_id: str, exc: BaseException) -> Failure:
    if isinstance(exc, engine_errors.DomainError):
        return Failure(request_id, type(exc).__name__, exc.message, exc.param)
    return Failure(request_id, "EngineError", f"{type(exc).__name__}: {exc}", None)


def error_of(item: Failure) -> engine_errors.DomainError:
    cls = getattr(engine_errors, item.error, None)
    if not (isinstance(cls, type) and issubclass(cls, engine_errors.DomainError)):
        cls = engine_errors.EngineError
    return cls(item.message, param=item.param)


class Codec:
    """One encoder and the two decoders (a process reads only one direction)."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.to_core = msgspec.msgpack.Decoder(ToCore)
        self.to_client = msgspec.msgpack.Decoder(ToClient)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self.encoder.encode(message)
