"""One claimed batch, from where it stands to its end: validate, run its lines, write its files, finish.

validating -> in_progress (or failed) -> finalizing -> completed; a cancel
(cancelling) or the end of the completion window lets the lines in flight
finish, fails the rest (`batch_cancelled` / `batch_expired` in the error
file) and ends cancelled / expired. A spent budget fails the remaining lines
with the budget's 429. Every step is safe to repeat: a batch resumed by
another worker (its first one died, or this server restarted) goes on from
its stored lines, and its files get the same ids when written again.

Lines run at most `batch_concurrency` at once. The first line of each model
runs alone first, so a prompt prefix the lines share is prefilled once and
read from the prefix cache by the others.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from loraplex.billing.unavailable import UNAVAILABLE_ERRORS
from loraplex.platform.batches.execution import LineOutcome, RetryLater, execute_line, usage_record
from loraplex.platform.batches.files import FileStore
from loraplex.platform.batches.line_models import LineModels
from loraplex.platform.batches.models import BatchLineRow, BatchRow
from loraplex.platform.batches.objects import (
    CANCELLED,
    CANCELLED_MESSAGE,
    CANCELLING,
    COMPLETED,
    EXPIRED,
    EXPIRED_MESSAGE,
    FINALIZING,
    IN_PROGRESS,
    OUTPUT_PURPOSE,
    VALIDATING,
    answered_line,
    batch_error,
    request_id_for,
    unanswered_line,
)
from loraplex.platform.batches.repository import LINE_COMPLETED, LINE_FAILED, BatchRepository
from loraplex.platform.batches.results import ResultWriter
from loraplex.platform.batches.validation import ValidatedFile, validate_file
from loraplex.platform.errors import ApiError
from loraplex.platform.services import Services

log = logging.getLogger(__name__)
PAGE = 256
MAX_RETRY_WAIT_S = 30.0


class BatchRun:
    def __init__(self, services: Services, files: FileStore, repo: BatchRepository, batch: BatchRow,
                 owner: str) -> None:
        self.services = services
        self.settings = services.settings
        self.files = files
        self.repo = repo
        self.batch = batch
        self.owner = owner
        self.lost = False                 # another worker holds the batch now (ours lapsed)
        self.stopping = False             # this server is shutting down
        self.cancelled = batch.status == CANCELLING
        self.budget_spent: LineOutcome | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.models = LineModels(services.extensions.model_resolver, batch.tenant_id)

    # -- the whole run ----------------------------------------------------------------------

    async def run(self) -> None:
        keeper = asyncio.create_task(self._keep_lease())
        lapse = False
        try:
            if self.batch.status == VALIDATING and not self.cancelled and not await self._validate():
                return
            if self.batch.status in (IN_PROGRESS, CANCELLING, FINALIZING):
                await self._run_lines()
                if not (self.lost or self.stopping):
                    await self._finish()
        except Exception:
            # Its lease is kept to lapse, not released: released, the oldest-first claim would take the same batch
            # up at once, again and again, and crowd other tenants' batches out of this server's slots.
            log.exception("batch %s stopped on an error; it is taken up again once its lease lapses", self.batch.id)
            lapse = True
        finally:
            keeper.cancel()
            if not (self.lost or lapse):
                await asyncio.to_thread(self.repo.release, self.batch.id, self.owner)

    def stop(self) -> None:
        """Shutting down: lines in flight are abandoned unbilled; the batch waits in the database for a worker."""
        self.stopping = True
        self._abandon()

    @property
    def expired(self) -> bool:
        return time.time() >= self.batch.expires_at

    @property
    def ending(self) -> bool:
        return self.lost or self.stopping or self.cancelled or self.expired or self.budget_spent is not None

    async def _keep_lease(self) -> None:
        lease_s = self.settings.batch_lease_s
        while True:
            await asyncio.sleep(lease_s / 3)
            try:
                row = await asyncio.to_thread(self.repo.renew, self.batch.id, self.owner, lease_s=lease_s)
            except UNAVAILABLE_ERRORS:
                log.warning("batch %s: the database is unreachable; renewing its lease again shortly", self.batch.id)
                continue
            if row is None:
                log.warning("batch %s: lease lost; its lines in flight are left to the worker holding it", self.batch.id)
                self.lost = True
                self._abandon()
                return
            if row.status == CANCELLING:
                self.cancelled = True
            self.batch.expires_at = row.expires_at

    def _abandon(self) -> None:
        for task in self._tasks:
            task.cancel()

    # -- validating -------------------------------------------------------------------------

    async def _validate(self) -> bool:
        batch = self.batch
        try:
            input_file = await asyncio.to_thread(self.files.get, batch.tenant_id, batch.input_file_id)
            path = self.files.path(input_file)
        except (ApiError, KeyError):
            errors = [batch_error("invalid_request", f"The input file {batch.input_file_id} no longer exists.",
                                  param="input_file_id")]
            await asyncio.to_thread(self.repo.fail_validation, batch.id, self.owner, errors)
            return False
        try:
            checked = await asyncio.to_thread(
                validate_file, path, endpoint=batch.endpoint, max_requests=self.settings.batch_max_requests,
                max_custom_id_chars=self.settings.batch_max_custom_id_chars)
        except OSError:
            raise  # the storage, not the file: tried again once the lease lapses
        except Exception:
            # The same file would fail the same way on every try: the batch fails now, with a line that says so.
            log.exception("batch %s: validating its input file failed", batch.id)
            errors = [batch_error("server_error", "The input file could not be validated; the batch was not run "
                                  "and nothing was billed.", param="input_file_id")]
            await asyncio.to_thread(self.repo.fail_validation, batch.id, self.owner, errors)
            return False
        if not checked.errors:
            await self._check_models(checked)
        if checked.errors:
            await asyncio.to_thread(self.repo.fail_validation, batch.id, self.owner, checked.errors)
            return False
        models = {line.model for line in checked.lines}
        model = models.pop() if len(models) == 1 else None
        if not await asyncio.to_thread(self.repo.start, batch.id, self.owner, checked.lines, model=model):
            return False
        self.batch = await asyncio.to_thread(self.repo.get, batch.tenant_id, batch.id)
        return True

    async def _check_models(self, checked: ValidatedFile) -> None:
        first_line: dict[str, int] = {}
        for plan in checked.lines:
            first_line.setdefault(plan.model, plan.index)
        resolver = self.services.extensions.model_resolver
        for model, index in first_line.items():
            try:
                await resolver.resolve(self.batch.tenant_id, model)
            except ApiError:
                checked.refuse("model_not_found", f"The model {model!r} does not exist or you do not have access "
                               "to it.", line=index + 1, param="body.model")

    # -- in progress ------------------------------------------------------------------------

    async def _run_lines(self) -> None:
        await self._meter_unmetered()
        writer = ResultWriter(self.repo, self.batch.id)
        slots = asyncio.Semaphore(self.settings.batch_concurrency)
        try:
            warm: set[str] = set()
            async for lines in self._pending_pages():
                firsts = {}
                for row, raw in lines:
                    if row.model not in warm and row.model not in firsts:
                        firsts[row.model] = (row, raw)
                warm.update(firsts)
                if firsts:  # the first line of each model alone: its prefix is in the cache for the rest
                    await asyncio.gather(*(self._line(row, raw, writer) for row, raw in firsts.values()))
                started = {row.line_index for row, _ in firsts.values()}
                for row, raw in lines:
                    if row.line_index in started:
                        continue
                    if self.ending:
                        break
                    await slots.acquire()
                    task = asyncio.create_task(self._line(row, raw, writer, slots))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                if self.ending:
                    break
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            await writer.close()

    async def _pending_pages(self) -> AsyncIterator[list[tuple[BatchLineRow, bytes]]]:
        input_file = await asyncio.to_thread(self.files.get, self.batch.tenant_id, self.batch.input_file_id)
        path = self.files.path(input_file)
        after = -1
        while not self.ending:
            rows = await asyncio.to_thread(self.repo.pending_lines, self.batch.id, after_index=after, limit=PAGE)
            if not rows:
                return
            after = rows[-1].line_index
            yield await asyncio.to_thread(_read_lines, path, rows)

    async def _line(self, row: BatchLineRow, raw: bytes, writer: ResultWriter,
                    slots: asyncio.Semaphore | None = None) -> None:
        """Run the line (its slot is given back once the engine is done with it), then store and meter it."""
        try:
            outcome = await self._execute(row, raw)
        finally:
            if slots is not None:
                slots.release()
        if outcome is None:
            return  # left pending: failed with the reason when the batch ends
        try:
            stored = await writer.store(outcome.result)
        except BaseException:
            await outcome.drop()
            raise
        if not stored:
            await outcome.drop()
            return
        await outcome.meter()
        writer.metered(row.line_index)
        if outcome.budget_spent and self.budget_spent is None:
            self.budget_spent = outcome

    async def _execute(self, row: BatchLineRow, raw: bytes) -> LineOutcome | None:
        """The line's outcome, run again after passing refusals; None when the batch ends first."""
        wait_s = 1.0
        while True:
            if self.budget_spent is not None or self.cancelled or self.expired:
                return None
            try:
                return await execute_line(self.services, self.batch, row, raw, self.models)
            except RetryLater as exc:
                log.info("batch %s line %d: %s; again in %.0f s", self.batch.id, row.line_index, exc, wait_s)
                await asyncio.sleep(wait_s)
                wait_s = min(wait_s * 2, MAX_RETRY_WAIT_S)

    async def _meter_unmetered(self) -> None:
        """Lines stored by a worker that died before the meter had their usage: recorded now (the ledger
        keeps one event per request id, so one that did reach it is not billed twice)."""
        rows = await asyncio.to_thread(self.repo.unmetered_lines, self.batch.id)
        if not rows:
            return
        input_file = await asyncio.to_thread(self.files.get, self.batch.tenant_id, self.batch.input_file_id)
        raws = await asyncio.to_thread(_read_lines, self.files.path(input_file), rows)
        for row, raw in raws:
            user = json.loads(raw).get("body", {}).get("user")
            record = usage_record(self.batch, row, user=user if isinstance(user, str) else None)
            for recorder in self.services.extensions.usage_recorders:
                await recorder.record(record)
        await asyncio.to_thread(self.repo.save_results, self.batch.id, [], [row.line_index for row in rows])

    # -- the end ----------------------------------------------------------------------------

    async def _finish(self) -> None:
        batch = self.batch
        num_pending = await asyncio.to_thread(self.repo.num_pending, batch.id)
        if not self.cancelled and not (num_pending and self.expired):
            if self.budget_spent is not None:
                body = json.loads(self.budget_spent.result.result)["response"]["body"]
                await asyncio.to_thread(self.repo.fail_pending, batch.id, lambda row: answered_line(
                    request_id_for(batch.id, row.custom_id), row.custom_id, status_code=429, body=body))
            elif num_pending:
                return  # lines a retry left behind when the run ended: the next claim runs them
            self.cancelled = not await asyncio.to_thread(
                self.repo.update_held, batch.id, self.owner, from_statuses=(IN_PROGRESS, FINALIZING),
                status=FINALIZING, finalizing_at=int(time.time()))  # refused: a cancel came in meanwhile
        if self.cancelled or (num_pending and self.expired):
            code, message, status = (("batch_cancelled", CANCELLED_MESSAGE, CANCELLED) if self.cancelled
                                      else ("batch_expired", EXPIRED_MESSAGE, EXPIRED))
            await asyncio.to_thread(self.repo.fail_pending, batch.id, lambda row: unanswered_line(
                request_id_for(batch.id, row.custom_id), row.custom_id, code=code, message=message))
        else:
            status = COMPLETED
        output_id, error_id = await asyncio.to_thread(self._write_files)
        stamp = {COMPLETED: "completed_at", CANCELLED: "cancelled_at", EXPIRED: "expired_at"}[status]
        stamped: dict[str, Any] = {stamp: int(time.time())}
        await asyncio.to_thread(self.repo.update_held, batch.id, self.owner, status=status,
                                output_file_id=output_id, error_file_id=error_id, **stamped)
        log.info("batch %s %s", batch.id, status)

    def _write_files(self) -> tuple[str | None, str | None]:
        return self._write_file(LINE_COMPLETED, "output"), self._write_file(LINE_FAILED, "error")

    def _write_file(self, status: str, kind: str) -> str | None:
        batch = self.batch
        file_id = "file-" + hashlib.sha256(f"{batch.id}:{kind}".encode()).hexdigest()[:24]
        expires_after = batch.output_expires_after_s or self.settings.batch_file_expires_after_s
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=self.files.uploads, suffix=".jsonl") as out:
            num_lines = 0
            for line in self.repo.results(batch.id, status):
                out.write(line + "\n")
                num_lines += 1
            if not num_lines:
                return None
            out.flush()
            self.files.add(tenant_id=batch.tenant_id, purpose=OUTPUT_PURPOSE, filename=f"{batch.id}_{kind}.jsonl",
                           path=Path(out.name), expires_at=int(time.time()) + expires_after, file_id=file_id)
        return file_id


def _read_lines(path: Path, rows: list[BatchLineRow]) -> list[tuple[BatchLineRow, bytes]]:
    with path.open("rb") as f:
        out = []
        for row in rows:
            f.seek(row.offset)
            out.append((row, f.read(row.length)))
        return out
