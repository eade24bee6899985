"""Stopping `serve`'s processes after the engine core died: a batch worker stuck in start-up (SIGTERM held behind
the dead core's handshake) is killed after a short grace instead of holding the supervisor's exit for the whole
drain timeout."""

from __future__ import annotations

import multiprocessing
import signal
import time
from typing import Any

from loraplex.platform.settings import Settings
from loraplex.platform.supervisor import BATCH_WORKER_NAME, Supervisor


def _deaf_to_sigterm(ready: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a process still waiting in its start-up
    ready.set()
    time.sleep(120)


def test_a_batch_worker_that_ignores_sigterm_is_killed_after_its_short_grace() -> None:
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    worker = context.Process(target=_deaf_to_sigterm, args=(ready,), name=BATCH_WORKER_NAME, daemon=True)
    worker.start()
    assert ready.wait(60)  # its SIGTERM handler is in place
    supervisor = Supervisor(Settings())
    supervisor.api_servers.append(worker)
    started = time.monotonic()
    supervisor._stop_api_servers(60, batch_worker_timeout_s=1.0)
    assert not worker.is_alive()
    assert time.monotonic() - started < 10  # not the 60 s drain timeout
    assert worker.exitcode == -signal.SIGKILL
