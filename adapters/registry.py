"""Tenant-scoped adapter records: names -> adapter ids, status, and the blobs they point at.

Every tenant-facing method takes `tenant_id` and filters by it: another
tenant's adapter is simply not found. The unscoped `find` exists for the
validation task and the engine's weight source, which work by adapter id.

`InMemoryAdapterRegistry` serves engine tests and single-process use;
`SqlAdapterRegistry` is the database-backed one the platform uses.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Protocol

from loraplex.adapters.errors import AdapterNameTakenError, AdapterNotFoundError
from loraplex.adapters.models import AdapterRecord, AdapterStatus, utcnow
from loraplex.adapters.storage_quota import StorageQuota
from loraplex.adapters.validation import AdapterSummary
from loraplex.engine.errors import InvalidRequestError
from sqlalchemy import case, func, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    id: str
    tenant_id: str
    name: str
    description: str
    status: str
    reason: str | None
    rank: int | None
    alpha: float | None
    target_modules: list[str]
    size_bytes: int
    sha256: str
    config_sha256: str
    base_model: str | None
    created_at: datetime
    ready_at: datetime | None


def check_adapter_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(
            "adapter name must be 1-64 characters of letters, digits, '.', '_' or '-', starting with a "
            "letter or digit",
            param="name",
        )


def new_adapter_id() -> str:
    return "adp_" + secrets.token_hex(12)


def split_model_name(model: str, base_model_id: str) -> str | None:
    """The adapter name a `model` field asks for, or None for the base model itself."""
    if model == base_model_id:
        return None
    prefix = base_model_id + ":"
    return model[len(prefix):] if model.startswith(prefix) else model


class AdapterRegistry(Protocol):
    def create(
        self, *, tenant_id: str, name: str, description: str, sha256: str, config_sha256: str,
        size_bytes: int, base_model: str | None, quota: StorageQuota | None = None,
    ) -> AdapterInfo:
        """A new `validating` record; with `quota`, the tenant's adapters are counted and the record created in
        one atomic step (StorageQuotaExceededError past it)."""

    def usage(self, *, tenant_id: str) -> tuple[int, int]:
        """The tenant's adapters that may still be served, and their weights' bytes."""

    def get(self, *, tenant_id: str, adapter_id: str) -> AdapterInfo: ...

    def get_by_name(self, *, tenant_id: str, name: str) -> AdapterInfo: ...

    def list(self, *, tenant_id: str) -> list[AdapterInfo]: ...

    def delete(self, *, tenant_id: str, adapter_id: str) -> AdapterInfo: ...

    def find(self, adapter_id: str) -> AdapterInfo | None:
        """Unscoped lookup by id, for the validation task and the engine's weight source only."""

    def mark_ready(self, adapter_id: str, summary: AdapterSummary) -> None: ...

    def mark_failed(self, adapter_id: str, reason: str) -> None: ...

    def num_blob_refs(self, sha256: str) -> int:
        """How many records (any tenant) that may still be served point at this blob, as weights or config.

        A failed record keeps its reason for the tenant to read but no longer holds its blobs."""

    def live_blob_digests(self) -> set[str]:
        """Every blob some record that may still be served points at (the storage sweep keeps these)."""


def resolve_adapter(registry: AdapterRegistry, *, tenant_id: str, model: str, base_model_id: str) -> AdapterInfo | None:
    """`model` as an API request names it -> the tenant's ready adapter, or None for the base model."""
    name = split_model_name(model, base_model_id)
    if name is None:
        return None
    try:
        info = registry.get_by_name(tenant_id=tenant_id, name=name)
    except AdapterNotFoundError:
        raise AdapterNotFoundError(f"The model '{model}' does not exist", param="model") from None
    if info.status != AdapterStatus.READY:
        raise InvalidRequestError(f"adapter '{name}' is not ready (status: {info.status})", param="model")
    return info


class InMemoryAdapterRegistry:
    def __init__(self) -> None:
        self._records: dict[str, AdapterInfo] = {}
        self._lock = threading.Lock()

    def create(
        self, *, tenant_id: str, name: str, description: str, sha256: str, config_sha256: str,
        size_bytes: int, base_model: str | None, quota: StorageQuota | None = None,
    ) -> AdapterInfo:
        check_adapter_name(name)
        with self._lock:
            if quota is not None:
                num_adapters, used_bytes = self._usage(tenant_id)
                quota.check(num_adapters=num_adapters, used_bytes=used_bytes, num_new_bytes=size_bytes)
            if any(r.tenant_id == tenant_id and r.name == name for r in self._records.values()):
                raise AdapterNameTakenError(f"an adapter named '{name}' already exists", param="name")
            info = AdapterInfo(
                id=new_adapter_id(), tenant_id=tenant_id, name=name, description=description,
                status=AdapterStatus.VALIDATING, reason=None, rank=None, alpha=None, target_modules=[],
                size_bytes=size_bytes, sha256=sha256, config_sha256=config_sha256, base_model=base_model,
                created_at=utcnow(), ready_at=None,
            )
            self._records[info.id] = info
            return info

    def usage(self, *, tenant_id: str) -> tuple[int, int]:
        with self._lock:
            return self._usage(tenant_id)

    def _usage(self, tenant_id: str) -> tuple[int, int]:
        """(records, bytes): a failed record counts until deleted (records are not free to keep), its bytes do
        not (its blobs are gone)."""
        records = [r for r in self._records.values() if r.tenant_id == tenant_id]
        return len(records), sum(r.size_bytes for r in records if r.status != AdapterStatus.FAILED)

    def get(self, *, tenant_id: str, adapter_id: str) -> AdapterInfo:
        info = self._records.get(adapter_id)
        if info is None or info.tenant_id != tenant_id:
            raise AdapterNotFoundError(f"adapter '{adapter_id}' not found")
        return info

    def get_by_name(self, *, tenant_id: str, name: str) -> AdapterInfo:
        for info in self._records.values():
            if info.tenant_id == tenant_id and info.name == name:
                return info
        raise AdapterNotFoundError(f"adapter '{name}' not found")

    def list(self, *, tenant_id: str) -> list[AdapterInfo]:
        return sorted((r for r in self._records.values() if r.tenant_id == tenant_id), key=lambda r: r.created_at)

    def delete(self, *, tenant_id: str, adapter_id: str) -> AdapterInfo:
        with self._lock:
            info = self.get(tenant_id=tenant_id, adapter_id=adapter_id)
            del self._records[adapter_id]
            return info

    def find(self, adapter_id: str) -> AdapterInfo | None:
        return self._records.get(adapter_id)

    def mark_ready(self, adapter_id: str, summary: AdapterSummary) -> None:
        with self._lock:
            info = self._records.get(adapter_id)
            if info is None:
                return  # deleted while validating
            self._records[adapter_id] = replace(
                info, status=AdapterStatus.READY, reason=None, rank=summary.rank, alpha=summary.alpha,
                target_modules=list(summary.target_modules), ready_at=utcnow(),
            )

    def mark_failed(self, adapter_id: str, reason: str) -> None:
        with self._lock:
            info = self._records.get(adapter_id)
            if info is None:
                return
            self._records[adapter_id] = replace(info, status=AdapterStatus.FAILED, reason=reason)

    def num_blob_refs(self, sha256: str) -> int:
        return sum(1 for r in self._records.values()
                   if r.status != AdapterStatus.FAILED and sha256 in (r.sha256, r.config_sha256))

    def live_blob_digests(self) -> set[str]:
        live = [r for r in self._records.values() if r.status != AdapterStatus.FAILED]
        return {r.sha256 for r in live} | {r.config_sha256 for r in live}


def _lock_key(tenant_id: str) -> int:
    """A signed 64-bit key for PostgreSQL's advisory locks, the same in every process."""
    return int.from_bytes(hashlib.blake2b(f"loraplex-adapters:{tenant_id}".encode(), digest_size=8).digest(),
                          "big", signed=True)


def _info(row: AdapterRecord) -> AdapterInfo:
    return AdapterInfo(
        id=row.id, tenant_id=row.tenant_id, name=row.name, description=row.description, status=row.status,
        reason=row.reason, rank=row.rank, alpha=row.alpha, target_modules=row.target_modules.split(),
        size_bytes=row.size_bytes, sha256=row.sha256, config_sha256=row.config_sha256,
        base_model=row.base_model, created_at=row.created_at, ready_at=row.ready_at,
    )


class SqlAdapterRegistry:
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions
        self._tenant_locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def create(
        self, *, tenant_id: str, name: str, description: str, sha256: str, config_sha256: str,
        size_bytes: int, base_model: str | None, quota: StorageQuota | None = None,
    ) -> AdapterInfo:
        """Counting the tenant's adapters and inserting the new one hold the tenant's lock: a thread lock in
        this process, and on PostgreSQL a transaction-scoped advisory lock for every other process."""
        check_adapter_name(name)
        row = AdapterRecord(
            id=new_adapter_id(), tenant_id=tenant_id, name=name, description=description,
            status=AdapterStatus.VALIDATING, size_bytes=size_bytes, sha256=sha256, config_sha256=config_sha256,
            base_model=base_model, target_modules="", created_at=utcnow(),
        )
        with self._tenant_lock(tenant_id), self._sessions() as db:
            if quota is not None and not quota.is_unlimited:
                if db.get_bind().dialect.name == "postgresql":
                    db.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _lock_key(tenant_id)})
                num_adapters, used_bytes = self._usage(db, tenant_id)
                quota.check(num_adapters=num_adapters, used_bytes=used_bytes, num_new_bytes=size_bytes)
            db.add(row)
            try:
                db.commit()
            except IntegrityError:
                raise AdapterNameTakenError(f"an adapter named '{name}' already exists", param="name") from None
            return _info(row)

    def usage(self, *, tenant_id: str) -> tuple[int, int]:
        with self._sessions() as db:
            return self._usage(db, tenant_id)

    def _usage(self, db: Session, tenant_id: str) -> tuple[int, int]:
        """As InMemoryAdapterRegistry._usage: failed records count, their bytes do not (a tenant's uploads that
        keep failing would otherwise pile up records without bound)."""
        live_bytes = case((AdapterRecord.status != AdapterStatus.FAILED, AdapterRecord.size_bytes), else_=0)
        count, used = db.execute(
            select(func.count(), func.coalesce(func.sum(live_bytes), 0)).where(AdapterRecord.tenant_id == tenant_id)
        ).one()
        return int(count), int(used)

    @contextmanager
    def _tenant_lock(self, tenant_id: str) -> Iterator[None]:
        with self._locks_lock:
            lock = self._tenant_locks.setdefault(tenant_id, threading.Lock())
        with lock:
            yield

    def _scoped(self, db: Session, tenant_id: str, adapter_id: str) -> AdapterRecord:
        row = db.scalar(select(AdapterRecord).where(AdapterRecord.id == adapter_id, AdapterRecord.tenant_id == tenant_id))
        if row is None:
            raise AdapterNotFoundError(f"adapter '{adapter_id}' not found")
        return row

    def get(self, *, tenant_id: str, adapter_id: str) -> AdapterInfo:
        with self._sessions() as db:
            return _info(self._scoped(db, tenant_id, adapter_id))

    def get_by_name(self, *, tenant_id: str, name: str) -> AdapterInfo:
        with self._sessions() as db:
            row = db.scalar(select(AdapterRecord).where(AdapterRecord.tenant_id == tenant_id, AdapterRecord.name == name))
            if row is None:
                raise AdapterNotFoundError(f"adapter '{name}' not found")
            return _info(row)

    def list(self, *, tenant_id: str) -> list[AdapterInfo]:
        with self._sessions() as db:
            rows = db.scalars(
                select(AdapterRecord).where(AdapterRecord.tenant_id == tenant_id).order_by(AdapterRecord.created_at)
            )
            return [_info(r) for r in rows]

    def delete(self, *, tenant_id: str, adapter_id: str) -> AdapterInfo:
        with self._sessions() as db:
            row = self._scoped(db, tenant_id, adapter_id)
            info = _info(row)
            db.delete(row)
            db.commit()
            return info

    def find(self, adapter_id: str) -> AdapterInfo | None:
        with self._sessions() as db:
            row = db.get(AdapterRecord, adapter_id)
            return None if row is None else _info(row)

    def mark_ready(self, adapter_id: str, summary: AdapterSummary) -> None:
        with self._sessions() as db:
            row = db.get(AdapterRecord, adapter_id)
            if row is None:
                return  # deleted while validating
            row.status, row.reason = AdapterStatus.READY, None
            row.rank, row.alpha = summary.rank, summary.alpha
            row.target_modules = " ".join(summary.target_modules)
            row.ready_at = utcnow()
            db.commit()

    def mark_failed(self, adapter_id: str, reason: str) -> None:
        with self._sessions() as db:
            row = db.get(AdapterRecord, adapter_id)
            if row is None:
                return
            row.status, row.reason = AdapterStatus.FAILED, reason
            db.commit()

    def num_blob_refs(self, sha256: str) -> int:
        with self._sessions() as db:
            return db.scalar(
                select(func.count()).select_from(AdapterRecord).where(
                    (AdapterRecord.sha256 == sha256) | (AdapterRecord.config_sha256 == sha256),
                    AdapterRecord.status != AdapterStatus.FAILED,
                )
            ) or 0

    def live_blob_digests(self) -> set[str]:
        with self._sessions() as db:
            rows = db.execute(select(AdapterRecord.sha256, AdapterRecord.config_sha256)
                              .where(AdapterRecord.status != AdapterStatus.FAILED))
            return {digest for row in rows for digest in row}
