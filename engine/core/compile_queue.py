"""The engine core's grammar compilations, shared fairly: at most `max_per_tenant` running per tenant, and the
free threads go to the tenants in turn.

The API servers cap each tenant's compilations per process, but the core
compiles every structured request's grammar again (its own cache) for all of
them together: one tenant's stream of distinct slow schemas would otherwise
fill the core's few compile threads and queue everyone's structured requests
behind it. Here each tenant waits in its own line; a thread that frees up
takes the next tenant's job (round robin) whose tenant is under its cap.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class _Job:
    job_id: str
    tenant_id: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: Future[Any] = field(default_factory=Future)


class TenantCompileQueue:
    def __init__(self, *, num_workers: int = 2, max_per_tenant: int = 1) -> None:
        self.num_workers = num_workers
        self.max_per_tenant = max_per_tenant  # 0: no cap (the tenants still take turns)
        self._pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="loraplex-grammar")
        self._waiting: OrderedDict[str, deque[_Job]] = OrderedDict()  # tenant -> its line, in turn order
        self._running: dict[str, int] = {}
        self._jobs: dict[str, _Job] = {}
        self._num_running = 0
        self._lock = threading.Lock()

    def num_running(self, tenant_id: str) -> int:
        with self._lock:
            return self._running.get(tenant_id, 0)

    def submit(self, job_id: str, tenant_id: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        job = _Job(job_id, tenant_id, fn, args)
        with self._lock:
            self._jobs[job_id] = job
            self._waiting.setdefault(tenant_id, deque()).append(job)
            self._dispatch()
        return job.future

    def cancel(self, job_id: str) -> None:
        """A job not started yet leaves its line; a running one finishes and is ignored."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.future.running() or job.future.done():
                return
            line = self._waiting.get(job.tenant_id)
            if line is not None and job in line:
                line.remove(job)
                if not line:
                    del self._waiting[job.tenant_id]
            del self._jobs[job_id]
            job.future.cancel()

    def shutdown(self) -> None:
        with self._lock:
            for line in self._waiting.values():
                for job in line:
                    job.future.cancel()
            self._waiting.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _dispatch(self) -> None:
        """Start jobs while threads are free: tenants in turn, each under its cap. Holds the lock."""
        while self._num_running < self.num_workers:
            tenant = next((t for t in self._waiting
                           if not self.max_per_tenant or self._running.get(t, 0) < self.max_per_tenant), None)
            if tenant is None:
                return
            line = self._waiting.pop(tenant)
            job = line.popleft()
            if line:
                self._waiting[tenant] = line  # to the back: the next tenant goes first
            self._running[tenant] = self._running.get(tenant, 0) + 1
            self._num_running += 1
            job.future.set_running_or_notify_cancel()
            self._pool.submit(self._run, job)

    def _run(self, job: _Job) -> None:
        try:
            result = job.fn(*job.args)
        except BaseException as exc:
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)
        finally:
            with self._lock:
                self._jobs.pop(job.job_id, None)
                self._num_running -= 1
                remaining = self._running[job.tenant_id] - 1
                if remaining:
                    self._running[job.tenant_id] = remaining
                else:
                    del self._running[job.tenant_id]
                self._dispatch()
