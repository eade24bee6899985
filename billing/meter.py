"""The meter: `record()` on the request path only enqueues; a writer thread does the rest.

The writer takes batches off the queue and writes them to the ledger. When
the database is unavailable, batches go to the first spool that takes them
(Redis stream, then local files), and the writer retries draining the spools
into the ledger until they are empty. Events that reached the ledger for the
first time are passed to `on_recorded` (quota spending), so a replayed event
is never counted twice there either.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.billing.events import UsageEvent
from loraplex.billing.ledger import Ledger, LedgerUnavailableError, WriteResult
from loraplex.billing.spool import Spool

log = logging.getLogger(__name__)

OnRecorded = Callable[[list[UsageEvent], dict[str, int]], None]


@dataclass(slots=True)
class MeterStats:
    num_recorded: int = 0     # record() calls
    num_written: int = 0      # new rows in the ledger (directly or drained)
    num_duplicates: int = 0   # events the ledger already had (replays)
    num_spooled: int = 0
    num_drained: int = 0
    num_rejected: int = 0     # rows the database refused (kept in the dead-letter spool)


class Meter:
    def __init__(
        self,
        ledger: Ledger,
        *,
        spools: list[Spool],
        dead_letter: Spool | None = None,
        on_recorded: OnRecorded | None = None,
        batch_size: int = 256,
        flush_interval_s: float = 0.02,
        retry_interval_s: float = 1.0,
    ) -> None:
        self._ledger = ledger
        self._spools = spools
        self._dead_letter = dead_letter
        self._on_recorded = on_recorded
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._retry_interval_s = retry_interval_s
        self._queue: queue.Queue[UsageEvent] = queue.Queue()
        self._stranded: list[UsageEvent] = []   # no spool would take them; retried, never dropped
        self._db_up = True
        self._spools_dirty = True               # a previous process may have left events behind
        self._last_drain_attempt = -float("inf")
        self._drain_failed = False
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = MeterStats()

    @property
    def db_available(self) -> bool:
        return self._db_up

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="billing-meter", daemon=True)
            self._thread.start()

    def record(self, event: UsageEvent) -> None:
        self.stats.num_recorded += 1
        self._queue.put_nowait(event)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every event recorded so far is in the ledger or a spool."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def num_pending_spooled(self) -> int:
        return len(self._stranded) + sum(spool.num_pending() for spool in self._spools)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write (or spool) everything still queued, then stop the writer."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if batch:
                self._deliver(batch)
                for _ in batch:
                    self._queue.task_done()
            if self._spools_dirty and self._drain_due():
                self._drain()
            if self._stopping.is_set() and self._queue.empty():
                return

    def _take_batch(self) -> list[UsageEvent]:
        try:
            batch = [self._queue.get(timeout=self._flush_interval_s)]
        except queue.Empty:
            return []
        while len(batch) < self._batch_size:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _deliver(self, batch: list[UsageEvent]) -> None:
        if self._db_up:
            try:
                self._written(self._ledger.write(batch))
                return
            except LedgerUnavailableError as error:
                log.warning("ledger unavailable (%s); spooling %d usage events", error, len(batch))
                self._db_up = False
            except Exception:
                log.exception("ledger write failed; spooling %d usage events", len(batch))
        self._spool(batch)

    def _spool(self, batch: list[UsageEvent]) -> None:
        self._spools_dirty = True
        for spool in self._spools:
            try:
                spool.append(batch)
            except Exception:
                log.exception("spool %s refused %d usage events; trying the next", type(spool).__name__, len(batch))
                continue
            self.stats.num_spooled += len(batch)
            return
        log.error("no spool took %d usage events; holding them in memory", len(batch))
        self._stranded += batch

    def _drain_due(self) -> bool:
        if self._db_up and not self._drain_failed:
            return True
        return time.monotonic() - self._last_drain_attempt >= self._retry_interval_s

    def _drain(self) -> None:
        """Move spooled events into the ledger, acknowledging each batch only after it is written."""
        self._last_drain_attempt = time.monotonic()
        self._drain_failed = True
        try:
            if self._stranded:
                self._written(self._ledger.write(self._stranded))
                self.stats.num_drained += len(self._stranded)
                self._stranded = []
            for spool in self._spools:
                while (batch := spool.peek(self._batch_size)) is not None:
                    self._written(self._ledger.write(batch.events))
                    spool.ack(batch)
                    self.stats.num_drained += len(batch.events)
        except LedgerUnavailableError:
            self._db_up = False
            return
        except Exception:
            log.exception("draining the usage spool failed; will retry")
            return
        if not self._db_up:
            log.info("ledger available again; spool drained")
        self._db_up = True
        self._drain_failed = False
        self._spools_dirty = False

    def _written(self, result: WriteResult) -> None:
        self.stats.num_written += len(result.inserted)
        self.stats.num_duplicates += len(result.duplicates)
        if result.rejected:
            self.stats.num_rejected += len(result.rejected)
            for event, reason in result.rejected:
                log.error("ledger refused usage event %s: %s", event.request_id, reason)
            if self._dead_letter is not None:
                self._dead_letter.append([event for event, _ in result.rejected])
        if result.inserted and self._on_recorded is not None:
            try:
                self._on_recorded(result.inserted, result.cost_picousd)
            except Exception:
                # Spending counters are reconciled from the ledger; a Redis hiccup must not stop metering.
                log.exception("recording spend for %d usage events failed", len(result.inserted))
