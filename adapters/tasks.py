"""Background validation of an uploaded adapter: one plain function, two ways to run it.

`validate_adapter_job(adapter_id, job)` is the task body. `job` is a plain,
JSON-serialisable dict (database URL, storage dir, the served model's shapes,
max rank, dtype), so a Celery worker needs nothing but the message to build
its context. The platform's Celery app registers it under `VALIDATE_TASK_NAME`
(its `TASKS` table); `CeleryValidationDispatcher` sends it through the broker,
and `ThreadValidationDispatcher` runs the SAME function in a worker thread
when no Redis is configured: validation is never skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from loraplex.adapters.archive import UploadLimits
from loraplex.adapters.base_model import BaseModelSpec
from loraplex.adapters.registry import AdapterInfo, AdapterRegistry, SqlAdapterRegistry
from loraplex.adapters.store import BlobStore, LocalBlobStore, drop_unreferenced_blobs, link_adapter_files
from loraplex.adapters.validation import validate_adapter
from loraplex.engine.errors import DomainError

VALIDATE_TASK_NAME = "loraplex.adapters.validate"
log = logging.getLogger(__name__)


@dataclass(slots=True)
class ValidationContext:
    registry: AdapterRegistry
    store: BlobStore
    spec: BaseModelSpec
    max_rank: int
    dtype: torch.dtype
    limits: UploadLimits


def make_job(
    *, database_url: str, storage_dir: Path, spec: BaseModelSpec, max_rank: int, dtype: str = "float32",
    limits: UploadLimits | None = None,
) -> dict[str, Any]:
    """The task's settings as a message-safe dict (what the platform passes to every dispatch)."""
    return {
        "database_url": database_url,
        "storage_dir": str(storage_dir),
        "spec": spec.to_dict(),
        "max_rank": max_rank,
        "dtype": dtype,
        "limits": dataclasses.asdict(limits or UploadLimits()),
    }


@functools.lru_cache(maxsize=8)
def _context_for(database_url: str, storage_dir: str, spec_json: str, max_rank: int, dtype: str,
                 limits_json: str = "{}") -> ValidationContext:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    engine = create_engine(database_url, pool_pre_ping=True)
    return ValidationContext(
        registry=SqlAdapterRegistry(sessionmaker(engine, expire_on_commit=False)),
        store=LocalBlobStore(Path(storage_dir)),
        spec=BaseModelSpec.from_dict(json.loads(spec_json)),
        max_rank=max_rank,
        dtype=getattr(torch, dtype),
        limits=UploadLimits(**json.loads(limits_json)),
    )


def validate_adapter_job(adapter_id: str, job: dict[str, Any]) -> str:
    """The task body (Celery or thread): validate one adapter and record the outcome; returns its status."""
    context = _context_for(
        job["database_url"], job["storage_dir"], json.dumps(job["spec"], sort_keys=True), int(job["max_rank"]),
        job.get("dtype", "float32"), json.dumps(job.get("limits", {}), sort_keys=True),
    )
    return run_validation(adapter_id, context)


def run_validation(adapter_id: str, context: ValidationContext) -> str:
    info = context.registry.find(adapter_id)
    if info is None:
        return "deleted"
    try:
        with tempfile.TemporaryDirectory(prefix="lpx-validate-") as tmp:
            folder = Path(tmp)
            link_adapter_files(context.store, folder, config_sha256=info.config_sha256, weights_sha256=info.sha256)
            _, summary = validate_adapter(
                folder, adapter_id, context.spec, max_rank=context.max_rank, dtype=context.dtype,
                limits=context.limits,
            )
    except DomainError as exc:
        _fail(context, info, exc.message)
        return "failed"
    except KeyError:
        _fail(context, info, "the adapter's files are missing from storage")
        return "failed"
    except Exception as exc:  # a bug must still end the record's `validating` state
        log.exception("validation of %s crashed", adapter_id)
        _fail(context, info, f"internal error during validation: {type(exc).__name__}")
        return "failed"
    context.registry.mark_ready(adapter_id, summary)
    return "ready"


def _fail(context: ValidationContext, info: AdapterInfo, reason: str) -> None:
    """Record the reason for the tenant, and free the blobs no adapter that may be served still needs."""
    context.registry.mark_failed(info.id, reason)
    drop_unreferenced_blobs(context.store, {info.sha256, info.config_sha256}, context.registry.num_blob_refs)


class ValidationDispatcher(Protocol):
    def submit(self, adapter_id: str) -> None: ...


class CeleryValidationDispatcher:
    def __init__(self, celery_app: Any, job: dict[str, Any]) -> None:
        self._app = celery_app
        self._job = job

    def submit(self, adapter_id: str) -> None:
        self._app.send_task(VALIDATE_TASK_NAME, args=[adapter_id, self._job], task_id=f"validate-{adapter_id}")


class ThreadValidationDispatcher:
    """No broker: the same task body in one background thread, one adapter at a time."""

    def __init__(self, job: dict[str, Any] | None = None, context: ValidationContext | None = None) -> None:
        if (job is None) == (context is None):
            raise ValueError("pass exactly one of job or context")
        self._job, self._context = job, context
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-validate")
        self._futures: list[Future[str]] = []
        self._lock = threading.Lock()

    def submit(self, adapter_id: str) -> None:
        if self._context is not None:
            future = self._pool.submit(run_validation, adapter_id, self._context)
        elif self._job is not None:
            future = self._pool.submit(validate_adapter_job, adapter_id, self._job)
        else:  # the constructor refuses that
            raise RuntimeError("a validation dispatcher with neither a job nor a context")
        with self._lock:
            self._futures = [f for f in self._futures if not f.done()] + [future]

    def wait_idle(self, timeout: float | None = None) -> None:
        with self._lock:
            pending = list(self._futures)
        for future in pending:
            future.result(timeout=timeout)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
