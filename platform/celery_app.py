"""The Celery app: broker and result backend are LORAPLEX_REDIS_URL.

Other domains' tasks are plain functions; they are registered here, in
`TASKS`, so their code never imports the platform. Without Redis the tasks
run eagerly in-process (single-machine default).

Run a worker: `celery -A loraplex.platform.celery_app:celery worker`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from celery import Celery
from loraplex.platform.settings import Settings

# "task name" -> "module:function". Registration spot for the other domains, e.g.
#   "adapters.validate": "loraplex.adapters.tasks:validate_adapter",
#   "billing.rollup_day": "loraplex.billing.tasks:rollup_day",
TASKS: dict[str, str] = {
    "loraplex.adapters.validate": "loraplex.adapters.tasks:validate_adapter_job",
    "loraplex.billing.rollup_and_reconcile": "loraplex.billing.tasks:rollup_and_reconcile",
}

# Celery beat: "entry name" -> {"task": <name in TASKS>, "schedule": seconds, "args": (...)}.
BEAT_SCHEDULE: dict[str, dict[str, Any]] = {}


def _resolve(target: str) -> Callable[..., Any]:
    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def _billing_beat(settings: Settings) -> dict[str, dict[str, Any]]:
    """Rollups and quota reconciliation need this deployment's database and Redis, known only here."""
    kwargs = {"database_url": settings.resolved_database_url, "redis_url": settings.redis_url,
              "key_prefix": settings.redis_key_prefix}
    return {"billing-rollups": {"task": "loraplex.billing.rollup_and_reconcile",
                                "schedule": settings.billing_rollup_interval_s, "kwargs": kwargs}}


def make_celery(settings: Settings | None = None) -> Celery:
    settings = settings or Settings()
    app = Celery("loraplex", broker=settings.redis_url or "memory://", backend=settings.redis_url or "cache+memory://")
    app.conf.update(
        task_always_eager=settings.celery_always_eager or settings.redis_url is None,
        task_eager_propagates=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_acks_late=True,              # a worker that dies mid-task leaves it for another
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        beat_schedule={**BEAT_SCHEDULE, **_billing_beat(settings)},
    )
    for name, target in TASKS.items():
        app.task(name=name, bind=False)(_resolve(target))
    return app


celery = make_celery()
