"""Readiness: may this API server take traffic now? (Liveness is /healthz: is the engine alive.)

Ready means: the engine is alive and stepping, the database answers, Redis
answers when configured, and the server is not draining. Each probe has a
short timeout, so a hung dependency makes /readyz answer 503 quickly rather
than hang. Whether a Celery worker is reachable (when Redis/Celery is
configured) is reported as a note, not a failure: inference goes on without
one, only adapter uploads wait for validation. That probe is cached briefly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from loraplex.platform.services import Services
from sqlalchemy import text

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
CELERY_PROBE_TTL_S = 15.0


@dataclass(slots=True)
class Readiness:
    not_ready: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return not self.not_ready


@dataclass(slots=True)
class _CeleryProbe:
    checked_at: float = float("-inf")
    note: str | None = None


async def check_readiness(services: Services) -> Readiness:
    result = Readiness()
    health = services.engine.health()
    if not health.alive:
        log.warning("readiness: the engine is not running: %s", health.reason)
        result.not_ready["engine"] = "the engine is not running (the server log says why)"
    if services.draining:
        result.not_ready["draining"] = "this server is shutting down; it finishes what it has and takes nothing new"
    probes = {"database": asyncio.to_thread(_ping_database, services)}
    if services.settings.redis_url:
        probes["redis"] = asyncio.to_thread(_ping_redis, services.settings.redis_url)
    for name, probe in probes.items():
        try:
            await asyncio.wait_for(probe, PROBE_TIMEOUT_S)
        except Exception:  # any failure of a probe is the answer: not ready, and which dependency
            # The exception's text can carry hosts, users and paths; /readyz needs no auth, so it goes to the log.
            log.warning("readiness probe %s failed", name, exc_info=True)
            result.not_ready[name] = "unreachable (the server log has the error)"
    note = await _celery_note(services)
    if note is not None:
        result.notes["uploads"] = note
    return result


def _ping_database(services: Services) -> None:
    with services.db_engine.connect() as connection:
        connection.execute(text("SELECT 1"))


def _ping_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=PROBE_TIMEOUT_S, socket_connect_timeout=PROBE_TIMEOUT_S)
    try:
        client.ping()
    finally:
        client.close()


async def _celery_note(services: Services) -> str | None:
    settings = services.settings
    if not settings.redis_url or settings.celery_always_eager:
        return None  # uploads are validated in this process
    probe: _CeleryProbe = services.extensions.domain_state.setdefault("readiness.celery", _CeleryProbe())
    if time.monotonic() - probe.checked_at > CELERY_PROBE_TTL_S:
        probe.checked_at = time.monotonic()
        try:
            replies = await asyncio.wait_for(asyncio.to_thread(_ping_celery, services), PROBE_TIMEOUT_S + 1)
        except Exception:
            replies = []
        probe.note = None if replies else (
            "no Celery worker answered: uploaded adapters stay 'validating' until one runs")
    return probe.note


def _ping_celery(services: Services) -> list[Any]:
    from loraplex.platform.celery_app import make_celery

    return make_celery(services.settings).control.ping(timeout=1.0) or []
