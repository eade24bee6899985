"""Where the other domains plug into a request, without the platform knowing them by name.

The platform runs every chat/completions request as:

    resolve model (ModelResolver) -> the pipeline's stages (pipeline.STAGE_ORDER)
    -> chat template + tokenize -> admission checks -> EngineRequest -> engine
    -> MessageParser turns generated text into content / reasoning / tool calls
    -> UsageRecorder.record(...) exactly once, in a `finally`, with the final counts

`wiring.build_extensions` fills an `Extensions` for the app; adapters, grammar,
sessions and billing add their objects there.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from loraplex.engine.protocol import ReasoningMarkers, SamplingParams
from loraplex.platform.errors import NotFoundError

if TYPE_CHECKING:
    from loraplex.platform.pipeline import Stage


@dataclass(slots=True, frozen=True)
class ServedModel:
    """One entry of /v1/models: the base model, or a tenant's adapter on top of it."""

    id: str
    adapter_id: str | None = None
    owned_by: str = "loraplex"
    created: int = field(default_factory=lambda: int(time.time()))


class ModelResolver(Protocol):
    async def list_models(self, tenant_id: str) -> list[ServedModel]: ...

    async def resolve(self, tenant_id: str, model: str) -> ServedModel:
        """The model a request named; raises NotFoundError for anything this tenant cannot see."""


# A lookup of `model` for one tenant that a caller brings instead of the resolver's (batch work: once for many lines)
ModelLookup = Callable[[str], Awaitable[ServedModel]]


class BaseModelResolver:
    """Serves only the base model; the adapters domain replaces it with one that knows adapters."""

    def __init__(self, base_model_name: str) -> None:
        self.base = ServedModel(id=base_model_name)

    async def list_models(self, tenant_id: str) -> list[ServedModel]:
        return [self.base]

    async def resolve(self, tenant_id: str, model: str) -> ServedModel:
        if model != self.base.id:
            raise NotFoundError(f"The model '{model}' does not exist", param="model", code="model_not_found")
        return self.base


@dataclass(slots=True)
class MessageDelta:
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI streaming tool_call deltas


class MessageParser(Protocol):
    """Splits one choice's generated text into message parts (grammar: reasoning, tool calls)."""

    def feed(self, text: str) -> MessageDelta: ...

    def finish(self, finish_reason: str) -> tuple[MessageDelta, str]:
        """Flush what is left; returns the final finish_reason (e.g. 'tool_calls')."""


class PlainTextParser:
    def feed(self, text: str) -> MessageDelta:
        return MessageDelta(content=text)

    def finish(self, finish_reason: str) -> tuple[MessageDelta, str]:
        return MessageDelta(), finish_reason


@dataclass(slots=True)
class PreparedRequest:
    """Everything known about a request before it reaches the engine.

    `body` is the validated request (ChatCompletionRequest or CompletionRequest):
    stages read their fields from it (response_format, tools, session_id...);
    only the pipeline writes what they return into it (pipeline.apply).
    """

    request_id: str
    kind: str                                   # "chat" | "completion"
    tenant_id: str
    key_id: str
    body: Any
    model: ServedModel
    sampling: SamplingParams
    messages: list[dict[str, Any]] | None = None  # chat only, as the chat template takes them
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. tools=[...] for the template
    prompts: list[list[int]] = field(default_factory=list)  # token ids; filled after templating
    grammar: Any = None                         # a CompiledGrammar (engine.interfaces)
    reasoning: ReasoningMarkers | None = None
    session_id: str | None = None
    cache_salt: str = ""
    priority: int = 0              # within the tenant, lower runs first (the request's `priority`)
    tenant_weight: float = 1.0     # the tenant's weight in the engine's fair sharing
    background: bool = False       # batch work: runs on capacity interactive requests leave
    batch_id: str | None = None    # the Batch API batch it is a line of (its usage is billed at the batch price)
    # /v1/completions with echo and max_tokens 0 (scoring a prompt): the engine samples one token, which the
    # response, the usage and the bill leave out
    echo_only: bool = False
    parser_factory: Callable[[], MessageParser] = PlainTextParser
    after_finish: list[Callable[[RequestRecord], Awaitable[None]]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    admission: Any = None   # api.admission.AdmissionTicket: the in-flight slots this request holds


class AdmissionCheck(Protocol):
    """Runs once the prompts' token ids are known, before anything is queued; may raise to refuse.

    For checks that need the request's size, such as a token budget this prompt
    would overrun. Refusals that need no size belong in a pipeline stage, which runs
    before the chat template and grammar compilation are paid for.
    """

    async def __call__(self, prepared: PreparedRequest) -> None: ...


class RequestStatus(StrEnum):
    COMPLETED = "completed"  # every choice ended on EOS (or its grammar terminated)
    STOPPED = "stopped"      # a stop string or stop token ended at least one choice
    LENGTH = "length"        # max_tokens or the context ended at least one choice
    ABORTED = "aborted"      # the client went away
    FAILED = "failed"        # an error; some tokens may still have been processed


@dataclass(slots=True)
class RequestRecord:
    """The final account of one API request (summed over its choices and prompts)."""

    request_id: str
    tenant_id: str
    key_id: str
    kind: str
    model: str
    adapter_id: str | None
    session_id: str | None
    status: RequestStatus
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    num_reasoning_tokens: int
    started_at: float                  # time.time()
    finished_at: float
    time_to_first_token_s: float | None
    error: str | None = None
    user: str | None = None            # the request's `user` (the caller's end-user id), for usage reports
    batch_id: str | None = None        # the Batch API batch this request is a line of (billed at the batch price)


class UsageRecorder(Protocol):
    """Billing's meter. Called exactly once per request; must not raise (failures are logged)."""

    async def record(self, record: RequestRecord) -> None: ...


@dataclass(slots=True)
class Extensions:
    model_resolver: ModelResolver
    stages: dict[str, Stage] = field(default_factory=dict)  # by name; pipeline.STAGE_ORDER orders them
    admission_checks: list[AdmissionCheck] = field(default_factory=list)
    usage_recorders: list[UsageRecorder] = field(default_factory=list)
    on_shutdown: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # Objects a domain's own routes need at request time, by domain name (e.g. "sessions").
    domain_state: dict[str, Any] = field(default_factory=dict)
