"""The adapter lifecycle as the API drives it: create from an upload, list, get, delete.

Owns the order of side effects so a refusal leaves nothing behind: checks run
on the staging folder first; blobs are stored only once the upload passed;
the record is created last, and its blobs are removed again if that fails.
Deleting drops the record, then the engine's copies, then blobs no other
record points at.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.adapters.archive import UploadLimits
from loraplex.adapters.errors import AdapterInUseError, StorageQuotaExceededError
from loraplex.adapters.models import AdapterStatus
from loraplex.adapters.peft_format import CONFIG_NAME, WEIGHTS_NAME
from loraplex.adapters.registry import AdapterInfo, AdapterRegistry, check_adapter_name
from loraplex.adapters.store import BlobStore
from loraplex.adapters.tasks import ValidationDispatcher
from loraplex.adapters.upload import receive_adapter_upload, run_upload_work
from loraplex.adapters.validation import check_upload
from loraplex.engine.errors import InvalidRequestError


@dataclass(slots=True)
class EngineAdapterHooks:
    """What the serving side tells the lifecycle (the engine's LoRA manager provides both)."""

    is_in_use: Callable[[str], bool] = lambda adapter_id: False
    evict: Callable[[str], None] = lambda adapter_id: None


@dataclass(frozen=True, slots=True)
class StorageQuota:
    """Per tenant: adapters that may still be served (failed ones hold no storage) and their weights' bytes."""

    max_bytes: int | None = None
    max_adapters: int | None = None


@dataclass(slots=True)
class AdapterService:
    registry: AdapterRegistry
    store: BlobStore
    dispatcher: ValidationDispatcher
    staging_root: Path
    limits: UploadLimits = field(default_factory=UploadLimits)
    hooks: EngineAdapterHooks = field(default_factory=EngineAdapterHooks)
    quota: StorageQuota = field(default_factory=StorageQuota)

    async def create_from_upload(
        self, *, tenant_id: str, chunks: AsyncIterator[bytes], content_type: str, content_length: int | None
    ) -> AdapterInfo:
        """Stream a multipart upload to a private staging folder, then `create_from_folder`; always cleans up."""
        await run_upload_work(self.check_quota, tenant_id=tenant_id, num_new_bytes=0)  # before receiving a byte
        self.staging_root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="upload-", dir=self.staging_root))
        try:
            received = await receive_adapter_upload(chunks, content_type, staging, self.limits, content_length)
            name = received.fields.get("name", "").strip()
            if not name:
                raise InvalidRequestError("the form field 'name' is required", param="name")
            description = received.fields.get("description", "")
            return await run_upload_work(
                self.create_from_folder, tenant_id=tenant_id, name=name, description=description,
                folder=received.folder,
            )
        finally:
            await run_upload_work(shutil.rmtree, staging, True)

    def create_from_folder(self, *, tenant_id: str, name: str, description: str, folder: Path) -> AdapterInfo:
        """Check the staged files, store them, create the record (`validating`) and queue validation."""
        check_adapter_name(name)
        config = check_upload(folder, self.limits)
        weights_path = folder / WEIGHTS_NAME
        self.check_quota(tenant_id=tenant_id, num_new_bytes=weights_path.stat().st_size)
        stored: list[str] = []
        try:
            config_sha = self.store.put_file(folder / CONFIG_NAME)
            stored.append(config_sha)
            weights_sha = self.store.put_file(weights_path)
            stored.append(weights_sha)
            info = self.registry.create(
                tenant_id=tenant_id, name=name, description=description, sha256=weights_sha,
                config_sha256=config_sha, size_bytes=weights_path.stat().st_size,
                base_model=config.base_model_name_or_path,
            )
        except BaseException:
            for sha in stored:
                self._drop_blob_if_unused(sha)
            raise
        self.dispatcher.submit(info.id)
        return info

    def check_quota(self, *, tenant_id: str, num_new_bytes: int) -> None:
        """Refuse one more adapter of `num_new_bytes` (0: is there room at all?) past the tenant's quota."""
        if self.quota.max_bytes is None and self.quota.max_adapters is None:
            return
        live = [i for i in self.registry.list(tenant_id=tenant_id) if i.status != AdapterStatus.FAILED]
        if self.quota.max_adapters is not None and len(live) + 1 > self.quota.max_adapters:
            raise StorageQuotaExceededError(
                f"the adapter quota is {self.quota.max_adapters} adapters per tenant and this tenant has "
                f"{len(live)}; delete one first"
            )
        used = sum(i.size_bytes for i in live)
        if self.quota.max_bytes is not None and used + max(num_new_bytes, 1) > self.quota.max_bytes:
            raise StorageQuotaExceededError(
                f"the adapter storage quota is {self.quota.max_bytes} bytes per tenant; this tenant uses "
                f"{used} and the upload adds {num_new_bytes}"
            )

    def delete(self, *, tenant_id: str, adapter_id: str) -> AdapterInfo:
        info = self.registry.get(tenant_id=tenant_id, adapter_id=adapter_id)
        if self.hooks.is_in_use(adapter_id):
            raise AdapterInUseError(f"adapter '{info.name}' is serving requests; retry when they finish")
        self.registry.delete(tenant_id=tenant_id, adapter_id=adapter_id)
        self.hooks.evict(adapter_id)
        for sha in {info.sha256, info.config_sha256}:
            self._drop_blob_if_unused(sha)
        return info

    def _drop_blob_if_unused(self, sha256: str) -> None:
        if self.registry.num_blob_refs(sha256) == 0:
            self.store.delete(sha256)
