"""A tenant's files: bytes in the adapter storage's content-addressed layout, records in the database.

Blobs live under `<adapter storage>/batch-files` as `blobs/ab/<sha256>` (the
adapters' LocalBlobStore, a folder of its own so the adapter sweep never
sees them), on the filesystem every replica shares. Identical bytes are
stored once; a blob is removed with the last file that names it. Input files
count against the tenant's quota (number and bytes); the output and error
files of its batches do not. Every query is scoped by tenant: another
tenant's file id is a 404, for reading, downloading and deleting alike.
"""

from __future__ import annotations

import contextlib
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from loraplex.adapters.store import LocalBlobStore
from loraplex.platform.batches.errors import FileInUseError, FileQuotaExceededError, file_not_found
from loraplex.platform.batches.models import BatchRow, FileRow
from loraplex.platform.batches.objects import ACTIVE_STATUSES, INPUT_PURPOSE, new_id
from loraplex.platform.batches.pagination import keyset_page
from sqlalchemy import delete, func, or_, select, text
from sqlalchemy.orm import Session, sessionmaker

_SQLITE_QUOTA_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class FileQuota:
    max_count: int | None = None   # input files per tenant; None: no limit
    max_bytes: int | None = None


class FileStore:
    def __init__(self, db_sessions: sessionmaker[Session], root: Path, *, quota: FileQuota) -> None:
        self.db_sessions = db_sessions
        self.blobs = LocalBlobStore(root)
        self.uploads = root / "uploads"          # uploads in progress (the caller deletes its own)
        self.uploads.mkdir(parents=True, exist_ok=True)
        self.quota = quota
        with db_sessions() as session:
            self._dialect = session.get_bind().dialect.name

    # -- writing ------------------------------------------------------------------------------

    def check_quota(self, tenant_id: str, *, num_new_bytes: int) -> None:
        with self.db_sessions() as session:
            self._check_quota(session, tenant_id, num_new_bytes)

    def add(self, *, tenant_id: str, purpose: str, filename: str, path: Path, expires_at: int | None,
            file_id: str | None = None) -> FileRow:
        """Store `path`'s bytes as a new file of the tenant (quota checked for input files, atomically);
        with `file_id`, a file of that id already stored is returned instead (a finalization done again)."""
        sha256 = self.blobs.put_file(path)
        size = path.stat().st_size
        row = FileRow(id=file_id or new_id("file-"), tenant_id=tenant_id, purpose=purpose, filename=filename,
                      bytes=size, sha256=sha256, created_at=int(time.time()), expires_at=expires_at)
        counted = purpose == INPUT_PURPOSE
        with self._quota_lock() if counted else contextlib.nullcontext():
            with self.db_sessions() as session, session.begin():
                if counted:
                    if self._dialect == "postgresql":
                        key = zlib.crc32(f"batch-files:{tenant_id}".encode())
                        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})
                    self._check_quota(session, tenant_id, size)
                elif file_id is not None and (stored := session.get(FileRow, file_id)) is not None:
                    session.expunge(stored)
                    return stored
                session.add(row)
            session.expunge_all()
        return row

    def _quota_lock(self) -> contextlib.AbstractContextManager[object]:
        """SQLite serializes writers, but a count read before an insert is not inside its write lock: a process
        lock covers the one process that uses a SQLite database (PostgreSQL: an advisory lock per tenant)."""
        return _SQLITE_QUOTA_LOCK if self._dialect == "sqlite" else contextlib.nullcontext()

    def _check_quota(self, session: Session, tenant_id: str, num_new_bytes: int) -> None:
        count, total = session.execute(
            select(func.count(), func.coalesce(func.sum(FileRow.bytes), 0))
            .where(FileRow.tenant_id == tenant_id, FileRow.purpose == INPUT_PURPOSE)
        ).one()
        if self.quota.max_count is not None and count + 1 > self.quota.max_count:
            raise FileQuotaExceededError(
                f"this tenant already has {count} files (batch_file_quota_count_per_tenant is "
                f"{self.quota.max_count}); delete some first")
        if self.quota.max_bytes is not None and total + num_new_bytes > self.quota.max_bytes:
            raise FileQuotaExceededError(
                f"this file would bring the tenant's files to {total + num_new_bytes} bytes, over "
                f"batch_file_quota_bytes_per_tenant ({self.quota.max_bytes}); delete some first")

    # -- reading ------------------------------------------------------------------------------

    def get(self, tenant_id: str, file_id: str) -> FileRow:
        with self.db_sessions() as session:
            row = session.get(FileRow, file_id)
            if row is None or row.tenant_id != tenant_id or _expired(row):
                raise file_not_found(file_id)
            session.expunge(row)
            return row

    def path(self, row: FileRow) -> Path:
        return self.blobs.local_path(row.sha256)

    def list(self, tenant_id: str, *, purpose: str | None, limit: int, order: str, after: str | None
             ) -> tuple[list[FileRow], bool]:
        """One page, newest first (`order="desc"`) or oldest first; `after` is the last id of the page before."""
        now = int(time.time())
        with self.db_sessions() as session:
            query = select(FileRow).where(FileRow.tenant_id == tenant_id,
                                          or_(FileRow.expires_at.is_(None), FileRow.expires_at > now))
            if purpose is not None:
                query = query.where(FileRow.purpose == purpose)
            cursor = None
            if after is not None:
                cursor = session.get(FileRow, after)
                if cursor is None or cursor.tenant_id != tenant_id:
                    raise file_not_found(after)
            query = keyset_page(query, FileRow, cursor, descending=order == "desc", limit=limit)
            rows = list(session.scalars(query))
            session.expunge_all()
        return rows[:limit], len(rows) > limit

    # -- removing -----------------------------------------------------------------------------

    def delete(self, tenant_id: str, file_id: str) -> None:
        """Remove the file (409 while a batch that is not finished reads it); its blob goes with its last file."""
        with self.db_sessions() as session, session.begin():
            row = session.get(FileRow, file_id)
            if row is None or row.tenant_id != tenant_id:
                raise file_not_found(file_id)
            in_use = session.scalar(select(func.count()).where(
                BatchRow.input_file_id == file_id, BatchRow.status.in_(ACTIVE_STATUSES)))
            if in_use:
                raise FileInUseError(f"file {file_id} is the input of a batch that has not finished; cancel it "
                                     "or wait for it to end", param="file_id")
            sha256 = row.sha256
            session.delete(row)
        self._drop_blob_if_unused(sha256)

    def sweep_expired(self, now: int | None = None) -> int:
        """Delete files past their `expires_at` (not the input of a batch still running); returns how many."""
        now = int(time.time()) if now is None else now
        with self.db_sessions() as session, session.begin():
            busy = select(BatchRow.input_file_id).where(BatchRow.status.in_(ACTIVE_STATUSES))
            expired = list(session.scalars(select(FileRow).where(
                FileRow.expires_at.is_not(None), FileRow.expires_at <= now, FileRow.id.not_in(busy))))
            if expired:
                session.execute(delete(FileRow).where(FileRow.id.in_([row.id for row in expired])))
            digests = {row.sha256 for row in expired}
        for digest in digests:
            self._drop_blob_if_unused(digest)
        return len(expired)

    def _drop_blob_if_unused(self, sha256: str) -> None:
        with self.db_sessions() as session:
            if session.scalar(select(func.count()).where(FileRow.sha256 == sha256)):
                return
        self.blobs.delete(sha256)


def _expired(row: FileRow) -> bool:
    return row.expires_at is not None and row.expires_at <= time.time()

