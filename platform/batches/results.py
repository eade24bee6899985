"""Group commit of finished lines: many lines' results in one transaction, each line told once it is stored.

A line is metered only after its result is stored (and told whether it was
stored: a line another worker finished first is dropped, not billed), and
the `metered` flags ride along with the next transaction. A database that
is down is waited for: lines hold their results until it comes back.
"""

from __future__ import annotations

import asyncio
import logging

from loraplex.billing.unavailable import UNAVAILABLE_ERRORS
from loraplex.platform.batches.repository import BatchRepository, LineResult

log = logging.getLogger(__name__)


class ResultWriter:
    def __init__(self, repo: BatchRepository, batch_id: str, *, linger_s: float = 0.05,
                 retry_interval_s: float = 1.0) -> None:
        self._repo = repo
        self._batch_id = batch_id
        self._linger_s = linger_s
        self._retry_interval_s = retry_interval_s
        self._pending: list[tuple[LineResult, asyncio.Future[bool]]] = []
        self._metered: list[int] = []
        self._wake = asyncio.Event()
        self._closed = False
        self._task = asyncio.create_task(self._run(), name=f"batch-results-{batch_id}")

    async def store(self, result: LineResult) -> bool:
        """True once this line's result is stored; False if the line already had one (another worker's)."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append((result, future))
        self._wake.set()
        return await future

    def metered(self, line_index: int) -> None:
        self._metered.append(line_index)

    async def close(self) -> None:
        """Store everything handed over (the last metered flags too) and stop."""
        self._closed = True
        self._wake.set()
        await self._task

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._closed:
                await asyncio.sleep(self._linger_s)  # let the lines finishing together share one transaction
            pending, self._pending = self._pending, []
            metered, self._metered = self._metered, []
            if pending or metered:
                stored = await self._save(pending, metered)
                for result, future in pending:
                    if not future.done():
                        future.set_result(result.index in stored)
            if self._closed and not self._pending and not self._metered:
                return

    async def _save(self, pending: list[tuple[LineResult, asyncio.Future[bool]]], metered: list[int]) -> set[int]:
        results = [result for result, _ in pending]
        while True:
            try:
                return await asyncio.to_thread(self._repo.save_results, self._batch_id, results, metered)
            except UNAVAILABLE_ERRORS:
                log.warning("the database is unreachable; batch %s keeps %d results until it is back",
                            self._batch_id, len(results))
                await asyncio.sleep(self._retry_interval_s)
