"""The engine core's grammar compilations are shared fairly: one tenant's slow compiles never hold every thread,
and a quiet tenant's job starts while the busy tenant's line still waits."""

from __future__ import annotations

import threading

from loraplex.engine.core.compile_queue import TenantCompileQueue


def test_a_busy_tenant_holds_at_most_its_cap_and_others_start_at_once() -> None:
    queue = TenantCompileQueue(num_workers=2, max_per_tenant=1)
    gate = threading.Event()
    started: list[str] = []
    lock = threading.Lock()

    def job(name: str, wait: bool) -> str:
        with lock:
            started.append(name)
        if wait:
            gate.wait(30)
        return name

    try:
        slow = [queue.submit(f"a{i}", "busy", job, f"a{i}", True) for i in range(5)]
        quiet = queue.submit("b0", "quiet", job, "b0", False)
        assert quiet.result(timeout=10) == "b0"  # while every one of the busy tenant's compiles is stuck
        assert queue.num_running("busy") == 1 and started.count("a0") == 1
        assert not any(f.done() for f in slow)
        queue.cancel("a4")  # a queued job leaves its line
        gate.set()
        assert [f.result(timeout=10) for f in slow[:4]] == ["a0", "a1", "a2", "a3"]
        assert slow[4].cancelled() and "a4" not in started
    finally:
        gate.set()
        queue.shutdown()


def test_tenants_take_turns_for_free_threads() -> None:
    queue = TenantCompileQueue(num_workers=1, max_per_tenant=0)
    gate = threading.Event()
    order: list[str] = []

    def job(name: str) -> None:
        if name == "first":
            gate.wait(30)
        order.append(name)

    try:
        first = queue.submit("first", "t0", job, "first")
        futures = [queue.submit(f"{tenant}{i}", tenant, job, f"{tenant}{i}") for tenant in ("a", "b") for i in range(3)]
        gate.set()
        first.result(timeout=10)
        for future in futures:
            future.result(timeout=10)
        assert order == ["first", "a0", "b0", "a1", "b1", "a2", "b2"]
    finally:
        queue.shutdown()


def test_a_failing_job_frees_its_place() -> None:
    queue = TenantCompileQueue(num_workers=1, max_per_tenant=1)

    def boom() -> None:
        raise ValueError("bad grammar")

    try:
        failed = queue.submit("x", "t", boom)
        assert isinstance(failed.exception(timeout=10), ValueError)
        assert queue.submit("y", "t", lambda: 7).result(timeout=10) == 7
    finally:
        queue.shutdown()
