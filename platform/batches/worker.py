"""The batch worker of one API server process, and the Batch API's wiring.

Where batches run, and why here: a line must go through the request
pipeline and the engine client, which only API server processes hold (a
Celery worker has neither the engine nor a GPU). So every API server runs
this asyncio worker beside its routes. It claims batches with a lease in the
database (shared by all replicas, PostgreSQL or the SQLite of a single
server; no Redis needed), runs up to `batch_max_running_per_server` of them
at once and renews their leases while they run. A worker that dies lets its
leases lapse (`batch_lease_s`) and any replica's worker takes the batch over
where it stopped; a server that shuts down hands its batches back at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from dataclasses import dataclass
from functools import partial

from loraplex.platform.batches.files import FileQuota, FileStore
from loraplex.platform.batches.repository import BatchRepository
from loraplex.platform.batches.runner import BatchRun
from loraplex.platform.services import Services

log = logging.getLogger(__name__)
FILE_SWEEP_INTERVAL_S = 600.0


class BatchWorker:
    def __init__(self, services: Services, files: FileStore, repo: BatchRepository) -> None:
        self.services = services
        self.settings = services.settings
        self.files = files
        self.repo = repo
        self.owner = f"{self.settings.replica_id}:{os.getpid()}:{secrets.token_hex(4)}"
        self.runs: dict[str, BatchRun] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._stopping = False
        self._loop_task: asyncio.Task[None] | None = None
        self._swept_at = 0.0

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop(), name="batch-worker")

    def wake(self) -> None:
        """A batch was created or cancelled here: look at once instead of at the next poll."""
        self._wake.set()

    def cancelled(self, batch_id: str) -> None:
        """A cancel was stored: a run of this process stops starting lines now, not at its next lease renewal."""
        run = self.runs.get(batch_id)
        if run is not None:
            run.cancelled = True
        self._wake.set()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        for run in self.runs.values():
            run.stop()
        if self._loop_task is not None:
            await self._loop_task
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=30)

    async def _loop(self) -> None:
        while not self._stopping:
            try:
                await self._claim_work()
                await self._sweep_files()
            except Exception:  # the database down, for one: try again at the next poll
                log.exception("batch worker: looking for work failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.settings.batch_poll_interval_s)
            self._wake.clear()

    async def _claim_work(self) -> None:
        while len(self.runs) < self.settings.batch_max_running_per_server and not self._stopping:
            batch = await asyncio.to_thread(self.repo.claim, self.owner, lease_s=self.settings.batch_lease_s,
                                            skip=set(self.runs))
            if batch is None:
                return
            if self._stopping:  # stopped while claiming: hand it straight back
                await asyncio.to_thread(self.repo.release, batch.id, self.owner)
                return
            run = BatchRun(self.services, self.files, self.repo, batch, self.owner)
            self.runs[batch.id] = run
            task = asyncio.create_task(run.run(), name=f"batch-{batch.id}")
            self._tasks[batch.id] = task
            task.add_done_callback(partial(self._done, batch.id))

    def _done(self, batch_id: str, _task: asyncio.Task[None]) -> None:
        self.runs.pop(batch_id, None)
        self._tasks.pop(batch_id, None)
        if not self._stopping:
            self._wake.set()  # room for another batch

    async def _sweep_files(self) -> None:
        if time.monotonic() - self._swept_at < FILE_SWEEP_INTERVAL_S:
            return
        self._swept_at = time.monotonic()
        num_removed = await asyncio.to_thread(self.files.sweep_expired)
        if num_removed:
            log.info("removed %d expired batch files", num_removed)


@dataclass(slots=True)
class BatchesDomain:
    files: FileStore
    repo: BatchRepository
    worker: BatchWorker | None


def install_batches(services: Services) -> BatchesDomain:
    """The file store, the batch records and (unless turned off) this process's worker, started now."""
    settings = services.settings
    quota = FileQuota(max_count=settings.batch_file_quota_count_per_tenant or None,
                      max_bytes=settings.batch_file_quota_bytes_per_tenant or None)
    files = FileStore(services.db_sessions, settings.resolved_adapter_storage_dir / "batch-files", quota=quota)
    repo = BatchRepository(services.db_sessions)
    worker = BatchWorker(services, files, repo) if settings.batch_workers_enabled else None
    domain = BatchesDomain(files=files, repo=repo, worker=worker)
    services.extensions.domain_state["batches"] = domain
    if worker is not None:
        worker.start()
        # First of the shutdown hooks: batches are handed back before the meter flushes and the engine stops.
        services.extensions.on_shutdown.insert(0, worker.stop)
    return domain
