"""Adapter storage quotas hold under concurrency: the count-and-create is atomic (PostgreSQL), uploads in progress
count their staged bytes and are bounded per tenant, and no blob another upload has just referenced is removed (by
a deletion or by the sweep)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from loraplex.adapters.archive import UploadLimits
from loraplex.adapters.errors import StorageQuotaExceededError, TooManyUploadsError
from loraplex.adapters.registry import InMemoryAdapterRegistry
from loraplex.adapters.service import AdapterService, StorageQuota
from loraplex.adapters.store import LocalBlobStore
from loraplex.adapters.sweep import sweep_storage
from loraplex.adapters.tasks import ThreadValidationDispatcher, ValidationContext
from loraplex.adapters.upload_slots import TenantUploads
from random_adapters import write_random_adapter


def _service(tmp_path: Path, spec: Any, registry: Any) -> AdapterService:
    store = LocalBlobStore(tmp_path / "adapters")
    context = ValidationContext(registry=registry, store=store, spec=spec, max_rank=64, dtype=torch.float32,
                                limits=UploadLimits())
    return AdapterService(registry=registry, store=store, dispatcher=ThreadValidationDispatcher(context=context),
                          staging_root=tmp_path / "adapters" / "staging")


def test_concurrent_uploads_never_pass_the_count_quota(tmp_path: Path, spec: Any, sql_registry: Any) -> None:
    service = _service(tmp_path, spec, sql_registry)
    service.quota = StorageQuota(max_adapters=3)
    folders = [write_random_adapter(tmp_path / f"a{i}", spec, r=2, seed=i) for i in range(8)]
    start = threading.Barrier(len(folders))
    outcomes: list[str] = []

    def upload(i: int) -> None:
        start.wait()
        try:
            service.create_from_folder(tenant_id="t1", name=f"a{i}", description="", folder=folders[i])
            outcomes.append("created")
        except StorageQuotaExceededError:
            outcomes.append("refused")

    threads = [threading.Thread(target=upload, args=(i,)) for i in range(len(folders))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    service.dispatcher.wait_idle(timeout=60)  # type: ignore[attr-defined]
    assert sorted(outcomes) == ["created"] * 3 + ["refused"] * 5
    assert sql_registry.usage(tenant_id="t1")[0] == 3
    live = sql_registry.live_blob_digests()
    assert service.store.count() == len(live)  # the refused ones left no blob behind
    # a failed record still counts as an adapter until deleted; its bytes no longer count
    first = sql_registry.list(tenant_id="t1")[0]
    count, used = sql_registry.usage(tenant_id="t1")
    sql_registry.mark_failed(first.id, "failed after the fact")
    assert sql_registry.usage(tenant_id="t1") == (count, used - first.size_bytes)


async def _chunks(num_chunks: int, size: int, gate: asyncio.Event | None = None) -> AsyncIterator[bytes]:
    for i in range(num_chunks):
        if gate is not None and i == 1:
            await gate.wait()
        yield b"x" * size


def test_uploads_in_progress_are_bounded_and_count_their_staged_bytes() -> None:
    uploads = TenantUploads(max_per_tenant=2)

    async def scenario() -> None:
        gate = asyncio.Event()
        with uploads.begin("t1") as first, uploads.begin("t1") as second:
            with pytest.raises(TooManyUploadsError), uploads.begin("t1"):
                pass
            with uploads.begin("t2"):
                pass  # another tenant's places are its own
            # Two uploads of 600 bytes each against 800 bytes with 100 stored: the one that passes it fails.
            async def drain(upload: Any, gate_: asyncio.Event | None) -> None:
                async for _ in uploads.counted(_chunks(3, 200, gate_), upload, num_stored_bytes=100, max_bytes=800):
                    pass

            held = asyncio.create_task(drain(first, gate))
            await asyncio.sleep(0)
            while first.num_bytes < 200:
                await asyncio.sleep(0.01)
            with pytest.raises(StorageQuotaExceededError, match="uploads in progress have received"):
                await drain(second, None)
            gate.set()
            with pytest.raises(StorageQuotaExceededError):
                await held
        assert uploads.num_uploads("t1") == 0 and uploads.staged_bytes("t1") == 0

    asyncio.run(scenario())


def test_a_repeated_upload_makes_its_blob_young_so_the_sweep_keeps_it(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "adapters")
    source = tmp_path / "weights.bin"
    source.write_bytes(os.urandom(1000))
    digest = store.put_file(source)
    old = time.time() - 7200
    os.utime(store.local_path(digest), (old, old))  # an orphan from long ago...
    registry = InMemoryAdapterRegistry()
    assert store.put_file(source) == digest  # ...that an identical upload stores again
    assert store.age_of(digest, time.time()) < 60
    swept = sweep_storage(registry, store, tmp_path / "adapters" / "staging", min_age_s=3600)
    assert swept.num_blobs_removed == 0 and store.exists(digest)


def test_a_deletion_never_removes_a_blob_another_tenants_upload_just_referenced(tmp_path: Path, spec: Any) -> None:
    service = _service(tmp_path, spec, InMemoryAdapterRegistry())
    folder = write_random_adapter(tmp_path / "same", spec, r=2)
    mine = service.create_from_folder(tenant_id="t1", name="mine", description="", folder=folder)
    service.dispatcher.wait_idle(timeout=60)  # type: ignore[attr-defined]
    referencing = threading.Event()
    release = threading.Event()
    theirs: list[Any] = []

    def identical_upload() -> None:
        # What create_from_folder does for another tenant's identical bytes, held open in the middle:
        with service.store.holding([mine.sha256, mine.config_sha256]):
            service.store.put_file(folder / "adapter_model.safetensors")
            service.store.put_file(folder / "adapter_config.json")
            referencing.set()
            release.wait(timeout=30)
            theirs.append(service.registry.create(
                tenant_id="t2", name="theirs", description="", sha256=mine.sha256, config_sha256=mine.config_sha256,
                size_bytes=mine.size_bytes, base_model=None))

    upload = threading.Thread(target=identical_upload)
    upload.start()
    assert referencing.wait(timeout=30)
    deletion = threading.Thread(target=service.delete, kwargs={"tenant_id": "t1", "adapter_id": mine.id})
    deletion.start()
    deletion.join(timeout=0.5)
    assert deletion.is_alive(), "the deletion waits for the blob's lock"
    release.set()
    upload.join(timeout=30)
    deletion.join(timeout=30)
    assert theirs and service.store.exists(mine.sha256) and service.store.exists(mine.config_sha256)
    service.delete(tenant_id="t2", adapter_id=theirs[0].id)
    assert not service.store.exists(mine.sha256)  # the last reference gone: removed at once
