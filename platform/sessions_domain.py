"""Sessions on the chat-completions path: the pipeline's `session` stage, its metrics and sweeper.

A chat completion with `session_id` sends only its new messages. The stage
takes the session's lease (409 if a turn is running), makes the model see
system prompt + transcript + new messages, supplies the session's tools /
tool_choice / response_format where the request leaves them unset, and sets
the engine request's session key so its KV stays pinned; the turn is
appended to the transcript only when it completes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator

from loraplex.engine.core.client import EngineClient
from loraplex.engine.errors import InvalidRequestError
from loraplex.platform.affinity import served_elsewhere
from loraplex.platform.extensions import (
    Extensions,
    MessageParser,
    PreparedRequest,
    RequestRecord,
    RequestStatus,
)
from loraplex.platform.metrics import Metrics
from loraplex.platform.pin_sweeper import sweep_while_running
from loraplex.platform.pipeline import StageAdditions
from loraplex.platform.settings import Settings
from loraplex.sessions.errors import SessionNotFoundError
from loraplex.sessions.memory_store import MemorySessionStore
from loraplex.sessions.quota import StoreQuota
from loraplex.sessions.redis_store import RedisSessionStore
from loraplex.sessions.store import KVState, SessionStore
from loraplex.sessions.turns import AnswerCapture, OpenTurn, SessionTurns, conversation
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

_RECORDED = {RequestStatus.COMPLETED, RequestStatus.STOPPED, RequestStatus.LENGTH}
_HELD = (KVState.PINNED, KVState.OFFLOADED)  # a replica's engine has the session's KV


class SessionStage:
    """pipeline.Stage turning a chat completion with `session_id` into a session turn (module docstring)."""

    def __init__(self, turns: SessionTurns, on_moved: Callable[[], None] = lambda: None) -> None:
        self.turns = turns
        self.on_moved = on_moved  # a turn whose KV another replica holds (platform/affinity.py)

    async def __call__(self, prepared: PreparedRequest) -> StageAdditions | None:
        session_id = prepared.session_id
        if session_id is None:
            return None
        if prepared.kind != "chat":
            raise InvalidRequestError("session_id is only supported on /v1/chat/completions", param="session_id")
        if prepared.sampling.n != 1:
            raise InvalidRequestError("a session turn has exactly one choice: n must be 1", param="n")
        new_messages = list(prepared.messages or [])
        turn = await asyncio.to_thread(self.turns.begin, prepared.tenant_id, session_id, new_messages)
        session = turn.lease.session
        if served_elsewhere(session.replica_id, self.turns.replica_id, session.kv_state in _HELD):
            self.on_moved()
        try:
            additions = self._additions(prepared, turn)
        except BaseException:
            await asyncio.to_thread(self.turns.abort, turn)
            raise
        # A request refused after this point (413, 429, 503...) never reaches `after_finish`;
        # the request's task ending is the backstop that frees the session.
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(lambda _task: self._abort_quietly(turn))
        return additions

    def _additions(self, prepared: PreparedRequest, turn: OpenTurn) -> StageAdditions:
        session = turn.lease.session
        if prepared.model.id != session.model:
            raise InvalidRequestError(
                f"session {session.id} was created for model {session.model!r}, not {prepared.model.id!r}",
                param="model",
            )
        defaults = {"tools": session.tools or None, "tool_choice": session.tool_choice,
                    "response_format": session.response_format or None}

        def capture(parser: MessageParser) -> MessageParser:
            turn.capture = AnswerCapture(parser)
            return turn.capture

        async def finish_turn(record: RequestRecord) -> None:
            await asyncio.to_thread(self._finish, turn, prepared, record)

        return StageAdditions(
            messages=conversation(session, turn.new_messages),
            request_defaults={k: v for k, v in defaults.items() if v is not None},
            parser_layer=capture, after_finish=[finish_turn],
        )

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
        """A done callback, run on the event loop: releasing the lease is store I/O (Redis: up to its socket
        timeout), so it runs in a thread, never on the loop."""
        if turn.closed:
            return
        try:
            asyncio.get_running_loop().run_in_executor(None, self._abort_logged, turn)
        except RuntimeError:  # the loop or its executor is shutting down: release it here, or it waits a lease
            self._abort_logged(turn)

    def _abort_logged(self, turn: OpenTurn) -> None:
        try:
            self.turns.abort(turn)
        except Exception:
            log.exception("could not release the lease of session %s", turn.lease.session.id)


class _SessionCollector(Collector):
    def __init__(self, turns: SessionTurns, engine: EngineClient) -> None:
        self._turns = turns
        self._engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._turns.stats
        yield GaugeMetricFamily("loraplex_sessions_pinned", "Sessions whose KV this replica holds",
                                value=self._turns.num_pinned_here)
        yield CounterMetricFamily("loraplex_session_turns", "Session turns completed", value=stats.num_turns)
        yield GaugeMetricFamily("loraplex_session_turn_cache_hit_rate",
                                "Prompt tokens of session turns served from pinned KV / all", value=stats.cache_hit_rate)
        engine_stats = self._engine.stats()
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


def session_quota(settings: Settings) -> StoreQuota:
    """Bytes per session and per tenant (the count is max_sessions_per_tenant, checked by `create`)."""
    return StoreQuota(what="sessions", max_bytes=settings.max_session_bytes_per_tenant,
                      max_record_bytes=settings.max_session_bytes, max_bytes_setting="max_session_bytes_per_tenant",
                      max_record_bytes_setting="max_session_bytes")


def install_sessions(extensions: Extensions, settings: Settings, *, engine: EngineClient,
                     metrics: Metrics | None) -> SessionTurns:
    """Register the session stage, the sweeper and the metrics."""
    turns = SessionTurns(make_session_store(settings), replica_id=settings.replica_id, lease_s=settings.session_lease_s,
                         release=engine.release_session, busy_wait_s=settings.session_busy_wait_s,
                         quota=session_quota(settings))
    extensions.domain_state["sessions"] = turns
    extensions.stages["session"] = SessionStage(turns, metrics.session_turns_moved.inc if metrics else lambda: None)
    if metrics is not None:
        metrics.register_collector(_SessionCollector(turns, engine))
    sweep_while_running(extensions, turns, settings.session_sweep_interval_s, "session")
    return turns
