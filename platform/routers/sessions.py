"""Sessions: /v1/sessions routes, and the `session_id` extension of chat completions.

A chat completion with `session_id` sends only its new messages. The
preparer takes the session's lease (409 if a turn is running), makes the
model see system prompt + transcript + new messages, and sets the engine
request's session key so its KV stays pinned; the turn is appended to the
transcript only when it completes. Scope `inference`; another tenant's
session is 404.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Query
from loraplex.engine.errors import InvalidRequestError
from loraplex.platform.deps import AppServices, InferenceKey
from loraplex.platform.extensions import (
    Extensions,
    PreparedRequest,
    RequestRecord,
    RequestStatus,
)
from loraplex.platform.metrics import Metrics
from loraplex.platform.settings import Settings
from loraplex.sessions.errors import SessionNotFoundError
from loraplex.sessions.memory_store import MemorySessionStore
from loraplex.sessions.redis_store import RedisSessionStore
from loraplex.sessions.store import KVState, SessionRecord, SessionStore, new_session_id
from loraplex.sessions.turns import AnswerCapture, OpenTurn, SessionTurns, conversation
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["sessions"])

_RECORDED = {RequestStatus.COMPLETED, RequestStatus.STOPPED, RequestStatus.LENGTH}


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    system: str | None = None
    ttl_seconds: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


def session_public(record: SessionRecord, *, with_transcript: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": record.id,
        "object": "session",
        "model": record.model,
        "created_at": int(record.created_at),
        "expires_at": int(record.expires_at),
        "ttl_seconds": record.ttl_seconds,
        "system": record.system,
        "tools": record.tools,
        "tool_choice": record.tool_choice,
        "response_format": record.response_format,
        "num_turns": record.num_turns,
        "num_tokens": record.num_tokens,
        "kv_state": record.kv_state,
        "replica_id": record.replica_id,
        "version": record.version,
        "last_turn": {"prompt_tokens": record.last_prompt_tokens, "cached_tokens": record.last_cached_tokens,
                      "completion_tokens": record.last_output_tokens},
    }
    if with_transcript:
        body["messages"] = record.messages
    return body


def _turns(services: Any) -> SessionTurns:
    return services.extensions.domain_state["sessions"]


@router.post("/sessions")
async def create_session(body: SessionCreate, key: InferenceKey, services: AppServices) -> dict[str, Any]:
    settings = services.settings
    ttl = settings.session_ttl_s if body.ttl_seconds is None else body.ttl_seconds
    if not 1 <= ttl <= settings.session_max_ttl_s:
        raise InvalidRequestError(f"ttl_seconds must be in [1, {settings.session_max_ttl_s}]", param="ttl_seconds")
    model = await services.extensions.model_resolver.resolve(key.tenant_id, body.model)
    record = SessionRecord(
        id=new_session_id(), tenant_id=key.tenant_id, model=model.id, adapter_id=model.adapter_id,
        system=body.system, tools=body.tools, tool_choice=body.tool_choice, response_format=body.response_format,
        ttl_seconds=ttl,
    )
    await asyncio.to_thread(_turns(services).store.create, record)
    return session_public(record)


@router.get("/sessions")
async def list_sessions(
    key: InferenceKey, services: AppServices,
    limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None,
) -> dict[str, Any]:
    page = await asyncio.to_thread(_turns(services).store.list, key.tenant_id, limit=limit, after=after)
    return {
        "object": "list", "data": [session_public(r, with_transcript=False) for r in page.data],
        "has_more": page.has_more, "first_id": page.first_id, "last_id": page.last_id,
    }


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, key: InferenceKey, services: AppServices) -> dict[str, Any]:
    record = await asyncio.to_thread(_turns(services).store.get, key.tenant_id, session_id)
    state_of = getattr(services.engine, "session_state", None)
    if state_of is not None and record.kv_state != KVState.NONE and record.replica_id == services.settings.replica_id:
        record.kv_state = state_of(record.id)  # the engine knows best where this replica's KV is now
    return session_public(record)


@router.delete("/sessions/{session_id}")
async def delete_session(session_id: str, key: InferenceKey, services: AppServices) -> dict[str, Any]:
    await asyncio.to_thread(_turns(services).delete, key.tenant_id, session_id)
    return {"id": session_id, "object": "session.deleted", "deleted": True}


class SessionPreparer:
    """Turns a chat completion with `session_id` into a session turn (see the module docstring)."""

    def __init__(self, turns: SessionTurns) -> None:
        self.turns = turns

    async def __call__(self, prepared: PreparedRequest) -> None:
        session_id = prepared.session_id
        if session_id is None:
            return
        if prepared.kind != "chat":
            raise InvalidRequestError("session_id is only supported on /v1/chat/completions", param="session_id")
        if prepared.sampling.n != 1:
            raise InvalidRequestError("a session turn has exactly one choice: n must be 1", param="n")
        new_messages = list(prepared.messages or [])
        turn = await asyncio.to_thread(self.turns.begin, prepared.tenant_id, session_id, new_messages)
        try:
            self._apply(prepared, turn)
        except BaseException:
            await asyncio.to_thread(self.turns.abort, turn)
            raise
        # A request refused after this point (413, 429, 503...) never reaches `after_finish`;
        # the request's task ending is the backstop that frees the session.
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(lambda _task: self._abort_quietly(turn))

    def _apply(self, prepared: PreparedRequest, turn: OpenTurn) -> None:
        session = turn.lease.session
        if prepared.model.id != session.model:
            raise InvalidRequestError(
                f"session {session.id} was created for model {session.model!r}, not {prepared.model.id!r}",
                param="model",
            )
        prepared.messages = conversation(session, turn.new_messages)
        body = prepared.body
        if body.tools is None and session.tools:
            body.tools = session.tools
        if body.tool_choice is None and session.tool_choice is not None:
            body.tool_choice = session.tool_choice
        if body.response_format is None and session.response_format:
            body.response_format = session.response_format
        original_factory = prepared.parser_factory

        def capturing_parser() -> AnswerCapture:
            turn.capture = AnswerCapture(original_factory())
            return turn.capture

        prepared.parser_factory = capturing_parser

        async def finish_turn(record: RequestRecord) -> None:
            await asyncio.to_thread(self._finish, turn, prepared, record)

        prepared.after_finish.append(finish_turn)

    def _finish(self, turn: OpenTurn, prepared: PreparedRequest, record: RequestRecord) -> None:
        # A client that hangs up right after the last chunk can make a finished turn look aborted;
        # the parser having seen the choice's finish is what says the answer is whole.
        answered = turn.capture is not None and turn.capture.finish_reason is not None
        if record.status not in _RECORDED and not (record.status == RequestStatus.ABORTED and answered):
            self.turns.abort(turn)
            return
        try:
            self.turns.complete(turn, prompt_token_ids=prepared.prompts[0], cached_tokens=record.num_cached_tokens,
                                output_tokens=record.num_output_tokens)
        except SessionNotFoundError:
            # Deleted or expired while the turn ran: the engine just pinned it again, so let go.
            self.turns.delete_local(turn.lease.session.id)
        except Exception:
            log.exception("session turn %s of %s could not be recorded", record.request_id, turn.lease.session.id)

    def _abort_quietly(self, turn: OpenTurn) -> None:
        if turn.closed:
            return
        try:
            self.turns.abort(turn)
        except Exception:
            log.exception("could not release the lease of session %s", turn.lease.session.id)


class _SessionCollector(Collector):
    def __init__(self, turns: SessionTurns, engine: Any) -> None:
        self._turns = turns
        self._engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._turns.stats
        yield GaugeMetricFamily("loraplex_sessions_pinned", "Sessions whose KV this replica holds",
                                value=self._turns.num_pinned_here)
        yield CounterMetricFamily("loraplex_session_turns", "Session turns completed", value=stats.num_turns)
        yield GaugeMetricFamily("loraplex_session_turn_cache_hit_rate",
                                "Prompt tokens of session turns served from pinned KV / all", value=stats.cache_hit_rate)
        engine_stats = self._engine.stats() if hasattr(self._engine, "stats") else {}
        for key, help_text in (("num_blocks_pinned_host", "Pinned session KV blocks held in host memory"),
                               ("num_session_offloads", "Session KV offloads to host memory"),
                               ("num_session_restores", "Session KV restores from host memory"),
                               ("num_session_drops", "Session KV dropped past the host budget")):
            if isinstance(engine_stats.get(key), int | float):
                yield GaugeMetricFamily(f"loraplex_{key}", help_text, value=float(engine_stats[key]))
        by_tenant = GaugeMetricFamily("loraplex_kv_blocks_pinned_by_tenant", "Device KV blocks pinned by "
                                      "each tenant's sessions", labels=["tenant"])
        for tenant, blocks in (engine_stats.get("pinned_blocks_by_tenant") or {}).items():
            by_tenant.add_metric([str(tenant)], float(blocks))
        yield by_tenant


def make_session_store(settings: Settings) -> SessionStore:
    if not settings.redis_url:
        return MemorySessionStore()
    import redis

    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
    return RedisSessionStore(client, key_prefix=settings.redis_key_prefix)


def install_sessions(extensions: Extensions, settings: Settings, *, engine: Any, metrics: Metrics | None) -> SessionTurns:
    """Register the session preparer (first, so grammar sees the session's tools), the sweeper and metrics."""
    release = getattr(engine, "release_session", None) or (lambda _key: None)
    turns = SessionTurns(make_session_store(settings), replica_id=settings.replica_id,
                         lease_s=settings.session_lease_s, release=release, busy_wait_s=settings.session_busy_wait_s)
    extensions.domain_state["sessions"] = turns
    extensions.preparers.insert(0, SessionPreparer(turns))
    if metrics is not None:
        metrics.registry.register(_SessionCollector(turns, engine))
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return turns  # no loop (a synchronous caller): nothing sweeps, sessions still work
    sweeper = loop.create_task(_sweep_forever(turns, settings.session_sweep_interval_s))

    async def stop_sessions() -> None:
        sweeper.cancel()
        turns.release_all_here()  # an engine that outlives this app (shared, in tests) must not keep the pins

    extensions.on_shutdown.append(stop_sessions)
    return turns


async def _sweep_forever(turns: SessionTurns, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await asyncio.to_thread(turns.sweep)
        except Exception:
            log.exception("session sweep failed")
