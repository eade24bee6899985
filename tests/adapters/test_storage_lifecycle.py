"""Storage is bounded per tenant and given back: quotas, failed adapters' blobs, the periodic sweep."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from loraplex.adapters.archive import UploadLimits
from loraplex.adapters.errors import StorageQuotaExceededError
from loraplex.adapters.models import AdapterStatus
from loraplex.adapters.registry import InMemoryAdapterRegistry
from loraplex.adapters.service import AdapterService, StorageQuota
from loraplex.adapters.store import LocalBlobStore
from loraplex.adapters.sweep import StorageSweeper, sweep_storage
from loraplex.adapters.tasks import ThreadValidationDispatcher, ValidationContext
from loraplex.platform.errors import status_for
from random_adapters import write_random_adapter
from waiting import wait_until


@pytest.fixture
def service(tmp_path: Path, spec) -> AdapterService:  # type: ignore[no-untyped-def]
    store = LocalBlobStore(tmp_path / "adapters")
    registry = InMemoryAdapterRegistry()
    context = ValidationContext(registry=registry, store=store, spec=spec, max_rank=64, dtype=torch.float32,
                                limits=UploadLimits())
    return AdapterService(registry=registry, store=store, dispatcher=ThreadValidationDispatcher(context=context),
                          staging_root=tmp_path / "adapters" / "staging")


def _upload(service: AdapterService, folder: Path, name: str, tenant: str = "t1"):  # type: ignore[no-untyped-def]
    info = service.create_from_folder(tenant_id=tenant, name=name, description="", folder=folder)
    service.dispatcher.wait_idle(timeout=60)  # type: ignore[attr-defined]
    return service.registry.find(info.id)


def test_quota_on_adapter_count_and_bytes_names_the_limit(service, tmp_path, spec):
    folder = write_random_adapter(tmp_path / "a", spec, r=2)
    size = (folder / "adapter_model.safetensors").stat().st_size
    service.quota = StorageQuota(max_adapters=2)
    _upload(service, folder, "one")
    _upload(service, write_random_adapter(tmp_path / "b", spec, r=2, seed=1), "two")
    with pytest.raises(StorageQuotaExceededError, match="quota is 2 adapters"):
        _upload(service, write_random_adapter(tmp_path / "c", spec, r=2, seed=2), "three")
    _upload(service, folder, "other-tenant", tenant="t2")  # quotas are per tenant
    service.quota = StorageQuota(max_bytes=2 * size + size // 2)
    with pytest.raises(StorageQuotaExceededError, match=f"storage quota is {2 * size + size // 2} bytes") as caught:
        _upload(service, write_random_adapter(tmp_path / "d", spec, r=2, seed=3), "four")
    assert status_for(caught.value) == 413 and caught.value.code == "storage_quota_exceeded"


def test_failed_validation_frees_its_blobs_but_keeps_its_reason(service, tmp_path, spec):
    folder = write_random_adapter(tmp_path / "big", spec, r=2)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "r": 4096}))  # past the maximum rank
    failed = _upload(service, folder, "too-big")
    assert failed.status == AdapterStatus.FAILED and "exceeds the maximum rank" in failed.reason
    assert service.store.count() == 0
    good = _upload(service, write_random_adapter(tmp_path / "good", spec, r=2), "good")
    assert good.status == AdapterStatus.READY and service.store.count() == 2
    # a failed record counts against the adapter count until deleted (uploads that keep failing cannot pile up)
    service.quota = StorageQuota(max_adapters=2)
    with pytest.raises(StorageQuotaExceededError, match="failed ones count until deleted"):
        _upload(service, write_random_adapter(tmp_path / "third", spec, r=2, seed=4), "third")
    service.delete(tenant_id="t1", adapter_id=failed.id)
    assert _upload(service, write_random_adapter(tmp_path / "third", spec, r=2, seed=4), "third").status == (
        AdapterStatus.READY)


def test_sweep_removes_orphans_and_stale_staging_only(service, tmp_path, spec):
    ready = _upload(service, write_random_adapter(tmp_path / "a", spec, r=2), "kept")
    orphan_source = tmp_path / "orphan.bin"
    orphan_source.write_bytes(os.urandom(1000))
    orphan = service.store.put_file(orphan_source)  # stored, but its record never made it
    service.staging_root.mkdir(parents=True, exist_ok=True)
    abandoned = service.staging_root / "upload-crashed"
    abandoned.mkdir()
    (abandoned / "adapter_model.safetensors").write_bytes(b"x" * 100)
    in_progress = service.staging_root / "upload-live"
    in_progress.mkdir()
    (in_progress / "adapter_model.safetensors").write_bytes(b"x")
    old = time.time() - 7200
    for path in [abandoned, abandoned / "adapter_model.safetensors", in_progress,
                 service.store.local_path(orphan), service.store.local_path(ready.sha256)]:
        os.utime(path, (old, old))

    result = sweep_storage(service.registry, service.store, service.staging_root, min_age_s=3600)
    assert (result.num_blobs_removed, result.num_staging_removed) == (1, 1)
    assert not service.store.exists(orphan) and service.store.exists(ready.sha256)
    assert not abandoned.exists() and in_progress.exists()  # its file was written a moment ago


def test_sweeper_thread_runs_periodically_and_stops(service, tmp_path):
    source = tmp_path / "orphan.bin"
    source.write_bytes(b"orphan")
    orphan = service.store.put_file(source)
    sweeper = StorageSweeper(service.registry, service.store, service.staging_root, interval_s=0.05, min_age_s=0)
    sweeper.start()
    wait_until(lambda: not service.store.exists(orphan), timeout_s=10, what="the sweeper to delete the orphan")
    sweeper.stop()
