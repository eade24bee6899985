"""The meter: write-ahead. `record()` is done once the event is in a durable spool; a writer fills the ledger.

Why write-ahead: an event held only in memory dies with the process (SIGKILL,
OOM, power loss) and its request goes unbilled. So every event takes this path:

    record() ─► journal thread ─► spool (Redis stream / fsynced file) ─► writer thread ─► ledger ─► ack

The journal thread group-commits: it appends whatever has queued up in one
Redis pipeline or one fsync, then completes each event's future. The platform
awaits that future before the request's last bytes go out, so a client that
saw its answer has been metered durably. The writer takes batches off the
spools, writes them to the idempotent ledger and only then acknowledges them;
when the database is unavailable it simply retries later (the events wait in
the spool), and a spool left by a dead process is taken over and drained.
Events that reached the ledger for the first time go to `on_recorded` (quota
spending), so a replayed event is never counted twice there either.

If no spool takes an event (Redis down *and* the disk refuses), the journal
thread writes it straight to the ledger; only if that fails too is it held
in memory and retried, with an error logged (the one case a crash can lose).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from loraplex.billing.events import UsageEvent
from loraplex.billing.ledger import Ledger, LedgerUnavailableError, WriteResult
from loraplex.billing.spool import Spool

log = logging.getLogger(__name__)

OnRecorded = Callable[[list[UsageEvent], dict[str, int]], None]


@dataclass(slots=True)
class MeterStats:
    num_recorded: int = 0     # record() calls
    num_journaled: int = 0    # events made durable in a spool
    num_written: int = 0      # new rows in the ledger
    num_duplicates: int = 0   # events the ledger already had (replays)
    num_rejected: int = 0     # rows the database refused (kept in the dead-letter spool)
    num_stranded: int = 0     # events no spool would take, held in memory until the ledger takes them


@dataclass(slots=True)
class _Pending:
    event: UsageEvent
    durable: Future[None]


class RecentRequestIds:
    """The request ids a meter recorded in the last `window_s` (at most `max_ids`): a lookup of an id that is
    not among them does not wait for the writer, so made-up ids cannot hold threads for seconds each."""

    def __init__(self, window_s: float = 60.0, max_ids: int = 100_000) -> None:
        self.window_s = window_s
        self.max_ids = max_ids
        self._ids: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, request_id: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._ids[request_id] = now
            self._ids.move_to_end(request_id)
            while self._ids and (len(self._ids) > self.max_ids or next(iter(self._ids.values())) < now - self.window_s):
                self._ids.popitem(last=False)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            seen = self._ids.get(request_id)
        return seen is not None and seen >= time.monotonic() - self.window_s


class Meter:
    def __init__(
        self,
        ledger: Ledger,
        *,
        spools: list[Spool],
        dead_letter: Spool | None = None,
        on_recorded: OnRecorded | None = None,
        batch_size: int = 256,
        retry_interval_s: float = 1.0,
        keep_alive_interval_s: float = 1.0,
        write_linger_s: float = 0.05,
    ) -> None:
        if not spools:
            raise ValueError("the meter needs at least one spool to journal events in")
        self._ledger = ledger
        self._spools = spools
        self._dead_letter = dead_letter
        self._on_recorded = on_recorded
        self._batch_size = batch_size
        self._retry_interval_s = retry_interval_s
        self._keep_alive_interval_s = keep_alive_interval_s
        self._write_linger_s = write_linger_s
        self._incoming: queue.Queue[_Pending] = queue.Queue()
        self._stranded: list[UsageEvent] = []   # only the writer thread touches it after handover
        self._stranded_lock = threading.Lock()
        self._journaled = threading.Event()     # wakes the writer when there is something to write
        self._db_up = True
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._recent = RecentRequestIds()
        self.stats = MeterStats()

    @property
    def db_available(self) -> bool:
        return self._db_up

    def start(self) -> None:
        if not self._threads:
            self._threads = [
                threading.Thread(target=self._journal_loop, name="billing-journal", daemon=True),
                threading.Thread(target=self._writer_loop, name="billing-meter", daemon=True),
            ]
            for thread in self._threads:
                thread.start()

    def record(self, event: UsageEvent) -> Future[None]:
        """Queue the event; the returned future completes once it is durable (await it before answering)."""
        self.stats.num_recorded += 1
        self._recent.add(event.request_id)
        pending = _Pending(event, Future())
        # Running from the start, so it cannot be cancelled: a request whose task is cancelled while it awaits
        # the future (asyncio.wrap_future cancels the future it wraps) must not make set_result raise in the
        # journal thread, which would stop it and leave every later record waiting.
        pending.durable.set_running_or_notify_cancel()
        if self._stopping.is_set() or not self._threads:
            # Not running (yet, or any more: a request that ends during shutdown): journal it here and now.
            self._journal([pending], queued=False)
        else:
            self._incoming.put_nowait(pending)
        return pending.durable

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every event recorded so far is durable (in a spool or the ledger)."""
        return self._wait_until(lambda: self._incoming.unfinished_tasks == 0, timeout_s)

    def recorded_recently(self, request_id: str) -> bool:
        """Whether this process recorded `request_id` lately (so it may still be on its way to the ledger)."""
        return request_id in self._recent

    def wait_written(self, timeout_s: float = 10.0) -> bool:
        """Wait until every event recorded so far is in the ledger (spools drained)."""
        return self._wait_until(lambda: self._incoming.unfinished_tasks == 0 and self.num_pending_spooled() == 0,
                                timeout_s)

    def num_pending_spooled(self) -> int:
        """Events durable but not yet in the ledger (this process's spools and those it took over)."""
        with self._stranded_lock:
            stranded = len(self._stranded)
        return stranded + sum(spool.num_pending() for spool in self._spools)

    def close(self, timeout_s: float = 10.0) -> None:
        """Journal everything queued, try once more to write the spools out, then release them."""
        self._stopping.set()
        self._journaled.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        self._threads = []
        leftovers = []  # recorded in the instant between the journal thread's last look and its exit
        while not self._incoming.empty():
            leftovers.append(self._incoming.get_nowait())
        if leftovers:
            self._journal(leftovers)
        for spool in self._spools:
            try:
                spool.close()
            except Exception:
                log.exception("closing spool %s failed", type(spool).__name__)

    # -- journal thread: group commit into the first spool that takes the batch ---------------------

    def _journal_loop(self) -> None:
        while True:
            batch = self._take_batch()
            if batch:
                self._journal(batch)
            elif self._stopping.is_set() and self._incoming.empty():
                return

    def _take_batch(self) -> list[_Pending]:
        try:
            batch = [self._incoming.get(timeout=0.1)]
        except queue.Empty:
            return []
        while len(batch) < self._batch_size:
            try:
                batch.append(self._incoming.get_nowait())
            except queue.Empty:
                break
        return batch

    def _journal(self, batch: list[_Pending], *, queued: bool = True) -> None:
        events = [pending.event for pending in batch]
        try:
            if self._append_to_a_spool(events):
                self.stats.num_journaled += len(events)
                self._journaled.set()
            else:
                self._write_past_the_spools(events)
        finally:
            for pending in batch:
                pending.durable.set_result(None)
                if queued:
                    self._incoming.task_done()

    def _append_to_a_spool(self, events: list[UsageEvent]) -> bool:
        for spool in self._spools:
            try:
                spool.append(events)
                return True
            except Exception:
                log.exception("spool %s refused %d usage events; trying the next", type(spool).__name__, len(events))
        return False

    def _write_past_the_spools(self, events: list[UsageEvent]) -> None:
        try:
            self._written(self._ledger.write(events))
            return
        except Exception:
            log.exception("no spool took %d usage events and the ledger refused them; holding them in memory",
                          len(events))
        with self._stranded_lock:
            self._stranded += events
        self.stats.num_stranded += len(events)

    # -- writer thread: spools → ledger, acknowledging only what the ledger has ---------------------

    def _writer_loop(self) -> None:
        next_keep_alive = 0.0
        while True:
            stopping = self._stopping.is_set()
            now = time.monotonic()
            if now >= next_keep_alive:
                self._keep_spools_alive()
                next_keep_alive = now + self._keep_alive_interval_s
            self._journaled.clear()
            self._drain()
            if stopping and not any(t.is_alive() for t in self._threads if t.name == "billing-journal"):
                self._drain()  # what the journal thread committed while we were draining
                return
            # Database down: back off. Up: sleep until the journal commits more (or a dead process's spool
            # may need adopting, which a periodic pass notices).
            wait_s = self._retry_interval_s if not self._db_up else min(self._keep_alive_interval_s, 1.0)
            if self._db_up and self._journaled.wait(wait_s):
                # Let more events gather: one ledger transaction per linger, not per request, keeps the
                # writer's GIL-holding work (and the database's commits) off the requests' critical path.
                self._stopping.wait(self._write_linger_s)
            elif not self._db_up:
                self._stopping.wait(wait_s)

    def _keep_spools_alive(self) -> None:
        for spool in self._spools:
            try:
                spool.keep_alive()
            except Exception:
                log.warning("could not renew the lease of spool %s", type(spool).__name__, exc_info=True)

    def _drain(self) -> None:
        try:
            self._drain_stranded()
            for spool in self._spools:
                self._drain_spool(spool)
        except LedgerUnavailableError as error:
            if self._db_up:
                log.warning("ledger unavailable (%s); usage events wait in the spool", error)
            self._db_up = False
            return
        except Exception:
            # Anything else (a bug, a surprising driver error) must not kill the writer: back off and retry.
            log.exception("writing spooled usage events failed; will retry")
            self._db_up = False
            return
        if not self._db_up:
            log.info("ledger available again; spooled usage events written")
        self._db_up = True

    def _drain_stranded(self) -> None:
        with self._stranded_lock:
            stranded, self._stranded = self._stranded, []
        if not stranded:
            return
        try:
            self._written(self._ledger.write(stranded))
        except BaseException:
            with self._stranded_lock:
                self._stranded = stranded + self._stranded
            raise

    def _drain_spool(self, spool: Spool) -> None:
        while True:
            try:
                batch = spool.peek(self._batch_size)
            except Exception:
                log.exception("reading spool %s failed; will retry", type(spool).__name__)
                return
            if batch is None:
                return
            self._written(self._ledger.write(batch.events))  # LedgerUnavailableError: stays spooled
            try:
                spool.ack(batch)
            except Exception:
                # Re-delivered later; the ledger ignores what it already has.
                log.exception("acknowledging %d usage events failed", len(batch.events))
                return

    def _written(self, result: WriteResult) -> None:
        self.stats.num_written += len(result.inserted)
        self.stats.num_duplicates += len(result.duplicates)
        if result.rejected:
            self.stats.num_rejected += len(result.rejected)
            for event, reason in result.rejected:
                log.error("ledger refused usage event %s: %s", event.request_id, reason)
            self._keep_dead_letters([event for event, _ in result.rejected])
        if result.inserted and self._on_recorded is not None:
            try:
                self._on_recorded(result.inserted, result.cost_picousd)
            except Exception:
                # Spending counters are reconciled from the ledger; a Redis hiccup must not stop metering.
                log.exception("recording spend for %d usage events failed", len(result.inserted))

    def _keep_dead_letters(self, events: list[UsageEvent]) -> None:
        """Rows the database will never take are acknowledged (or they'd block the spool) but not dropped."""
        try:
            if self._dead_letter is not None:
                self._dead_letter.append(events)
                return
        except Exception:
            log.exception("the dead-letter spool refused %d usage events", len(events))
        for event in events:
            log.error("unwritable usage event kept only in this log: %s", event.to_json())

    @staticmethod
    def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True
