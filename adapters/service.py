"""The adapter lifecycle as the API drives it: create from an upload, list, get, delete.

Owns the order of side effects so a refusal leaves nothing behind: checks run
on the staging folder first; blobs are stored only once the upload passed;
the record is created last (under the tenant's quota, atomically), and its
blobs are removed again if that fails. Deleting drops the record, then the
engine's copies, then blobs no other record points at. Storing a blob and
referencing it, and finding it unreferenced and removing it, each happen
under the blob's lock, so a deletion never removes a blob another tenant's
identical upload has just referenced.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.adapters.archive import UploadLimits
from loraplex.adapters.errors import AdapterInUseError
from loraplex.adapters.peft_format import CONFIG_NAME, WEIGHTS_NAME
from loraplex.adapters.registry import AdapterInfo, AdapterRegistry, check_adapter_name
from loraplex.adapters.storage_quota import StorageQuota
from loraplex.adapters.store import BlobStore, drop_unreferenced_blobs, sha256_of_file
from loraplex.adapters.tasks import ValidationDispatcher
from loraplex.adapters.upload import receive_adapter_upload, run_upload_work
from loraplex.adapters.upload_slots import TenantUploads
from loraplex.adapters.validation import check_upload
from loraplex.engine.errors import InvalidRequestError


@dataclass(slots=True)
class EngineAdapterHooks:
    """What the serving side tells the lifecycle (the engine's LoRA manager provides both)."""

    is_in_use: Callable[[str], bool] = lambda adapter_id: False
    evict: Callable[[str], None] = lambda adapter_id: None


@dataclass(slots=True)
class AdapterService:
    registry: AdapterRegistry
    store: BlobStore
    dispatcher: ValidationDispatcher
    staging_root: Path
    limits: UploadLimits = field(default_factory=UploadLimits)
    hooks: EngineAdapterHooks = field(default_factory=EngineAdapterHooks)
    quota: StorageQuota = field(default_factory=StorageQuota)
    uploads: TenantUploads = field(default_factory=TenantUploads)

    async def create_from_upload(
        self, *, tenant_id: str, chunks: AsyncIterator[bytes], content_type: str, content_length: int | None
    ) -> AdapterInfo:
        """Stream a multipart upload to a private staging folder, then `create_from_folder`; always cleans up.

        The upload holds one of the tenant's upload places while it runs, and the bytes it receives count
        against the tenant's storage quota as they arrive (upload_slots.py)."""
        num_adapters, used_bytes = await run_upload_work(self.registry.usage, tenant_id=tenant_id)
        self.quota.check(num_adapters=num_adapters, used_bytes=used_bytes, num_new_bytes=0)  # before a byte
        with self.uploads.begin(tenant_id) as upload:
            counted = self.uploads.counted(chunks, upload, num_stored_bytes=used_bytes, max_bytes=self.quota.max_bytes)
            self.staging_root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix="upload-", dir=self.staging_root))
            try:
                received = await receive_adapter_upload(counted, content_type, staging, self.limits, content_length)
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
        """Check the staged files, store them, create the record (`validating`) and queue validation.

        Storing the blobs and creating the record that references them hold the blobs' locks, and the record
        is created under the quota atomically (the registry counts and inserts in one step)."""
        check_adapter_name(name)
        config = check_upload(folder, self.limits)
        weights_path = folder / WEIGHTS_NAME
        size_bytes = weights_path.stat().st_size
        num_adapters, used_bytes = self.registry.usage(tenant_id=tenant_id)
        self.quota.check(num_adapters=num_adapters, used_bytes=used_bytes, num_new_bytes=size_bytes)  # early out
        config_sha, weights_sha = sha256_of_file(folder / CONFIG_NAME), sha256_of_file(weights_path)
        with self.store.holding([config_sha, weights_sha]):
            try:
                self.store.put_file(folder / CONFIG_NAME, sha256=config_sha)
                self.store.put_file(weights_path, sha256=weights_sha)
                info = self.registry.create(
                    tenant_id=tenant_id, name=name, description=description, sha256=weights_sha,
                    config_sha256=config_sha, size_bytes=size_bytes, base_model=config.base_model_name_or_path,
                    quota=self.quota,
                )
            except BaseException:
                for sha in {config_sha, weights_sha}:
                    if self.registry.num_blob_refs(sha) == 0:
                        self.store.delete(sha)
                raise
        self.dispatcher.submit(info.id)
        return info

    def delete(self, *, tenant_id: str, adapter_id: str) -> AdapterInfo:
        info = self.registry.get(tenant_id=tenant_id, adapter_id=adapter_id)
        if self.hooks.is_in_use(adapter_id):
            raise AdapterInUseError(f"adapter '{info.name}' is serving requests; retry when they finish")
        self.registry.delete(tenant_id=tenant_id, adapter_id=adapter_id)
        self.hooks.evict(adapter_id)
        drop_unreferenced_blobs(self.store, {info.sha256, info.config_sha256}, self.registry.num_blob_refs)
        return info

