"""Uploads in progress, per tenant, in this process: how many may run at once, and the bytes they have staged.

An upload is received to a staging folder before anything is stored, and a
tenant's committed adapters alone do not say how much disk it is taking: a
tenant with many large uploads in flight could fill the disk while every one
of them is still "within quota". So each upload takes a place (at most
`max_per_tenant`, else 429 `too_many_uploads`), and every chunk it receives
counts against the tenant's storage quota together with its stored adapters
and its other uploads' staged bytes (413 `storage_quota_exceeded` the moment
the sum passes it).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from loraplex.adapters.errors import StorageQuotaExceededError, TooManyUploadsError


@dataclass(slots=True)
class StagedUpload:
    tenant_id: str
    num_bytes: int = 0


@dataclass(slots=True)
class TenantUploads:
    max_per_tenant: int = 0  # 0: no cap
    _uploads: dict[str, list[StagedUpload]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def num_uploads(self, tenant_id: str) -> int:
        with self._lock:
            return len(self._uploads.get(tenant_id, ()))

    def staged_bytes(self, tenant_id: str) -> int:
        with self._lock:
            return sum(upload.num_bytes for upload in self._uploads.get(tenant_id, ()))

    @contextmanager
    def begin(self, tenant_id: str) -> Iterator[StagedUpload]:
        upload = StagedUpload(tenant_id)
        with self._lock:
            running = self._uploads.setdefault(tenant_id, [])
            if self.max_per_tenant and len(running) >= self.max_per_tenant:
                if not running:
                    del self._uploads[tenant_id]
                raise TooManyUploadsError(
                    f"this tenant already has {len(running)} adapter uploads in progress "
                    f"(max_concurrent_uploads_per_tenant); retry when one finishes")
            running.append(upload)
        try:
            yield upload
        finally:
            with self._lock:
                running = self._uploads[tenant_id]
                running.remove(upload)
                if not running:
                    del self._uploads[tenant_id]

    async def counted(self, chunks: AsyncIterator[bytes], upload: StagedUpload, *, num_stored_bytes: int,
                      max_bytes: int | None) -> AsyncIterator[bytes]:
        """`chunks`, each counted as staged; past `max_bytes` (with the tenant's stored and staged bytes) the
        upload ends with StorageQuotaExceededError."""
        async for chunk in chunks:
            with self._lock:
                upload.num_bytes += len(chunk)
                staged = sum(u.num_bytes for u in self._uploads.get(upload.tenant_id, ()))
            if max_bytes is not None and num_stored_bytes + staged > max_bytes:
                raise StorageQuotaExceededError(
                    f"the adapter storage quota is {max_bytes} bytes per tenant (adapter_quota_bytes_per_tenant); "
                    f"this tenant stores {num_stored_bytes} and its uploads in progress have received {staged}")
            yield chunk
