"""Tenant-scoped registry: in-memory and PostgreSQL (migrated by Alembic) behave the same."""

from __future__ import annotations

import pytest
from loraplex.adapters.errors import AdapterNameTakenError, AdapterNotFoundError
from loraplex.adapters.registry import InMemoryAdapterRegistry, resolve_adapter
from loraplex.adapters.validation import AdapterSummary
from loraplex.engine.errors import InvalidRequestError

BASE = "SmolLM2-135M-Instruct"


@pytest.fixture(params=["memory", "postgres"])
def registry(request):  # type: ignore[no-untyped-def]
    if request.param == "memory":
        return InMemoryAdapterRegistry()
    return request.getfixturevalue("sql_registry")


def _create(registry, tenant: str, name: str, sha: str = "a" * 64):  # type: ignore[no-untyped-def]
    return registry.create(
        tenant_id=tenant, name=name, description="d", sha256=sha, config_sha256="c" * 64,
        size_bytes=123, base_model=BASE,
    )


def test_names_unique_per_tenant_not_globally(registry):
    first = _create(registry, "ten_a", "pirate")
    with pytest.raises(AdapterNameTakenError):
        _create(registry, "ten_a", "pirate")
    other = _create(registry, "ten_b", "pirate")
    assert first.id != other.id
    assert [a.id for a in registry.list(tenant_id="ten_a")] == [first.id]


def test_other_tenant_gets_not_found_everywhere(registry):
    info = _create(registry, "ten_a", "pirate")
    with pytest.raises(AdapterNotFoundError):
        registry.get(tenant_id="ten_b", adapter_id=info.id)
    with pytest.raises(AdapterNotFoundError):
        registry.delete(tenant_id="ten_b", adapter_id=info.id)
    registry.mark_ready(info.id, AdapterSummary(8, 16.0, ["q_proj"], 60, 123, BASE))
    with pytest.raises(AdapterNotFoundError):
        resolve_adapter(registry, tenant_id="ten_b", model="pirate", base_model_id=BASE)
    assert registry.list(tenant_id="ten_b") == []
    assert registry.get(tenant_id="ten_a", adapter_id=info.id).status == "ready"


def test_resolution_by_name_and_base_prefix(registry):
    info = _create(registry, "ten_a", "pirate")
    with pytest.raises(InvalidRequestError, match="not ready"):
        resolve_adapter(registry, tenant_id="ten_a", model="pirate", base_model_id=BASE)
    registry.mark_ready(info.id, AdapterSummary(8, 16.0, ["q_proj", "v_proj"], 60, 123, BASE))
    assert resolve_adapter(registry, tenant_id="ten_a", model="pirate", base_model_id=BASE).id == info.id
    assert resolve_adapter(registry, tenant_id="ten_a", model=f"{BASE}:pirate", base_model_id=BASE).id == info.id
    assert resolve_adapter(registry, tenant_id="ten_a", model=BASE, base_model_id=BASE) is None
    ready = registry.get(tenant_id="ten_a", adapter_id=info.id)
    assert (ready.rank, ready.alpha, ready.target_modules) == (8, 16.0, ["q_proj", "v_proj"])
    assert ready.ready_at is not None


def test_failed_records_reason_and_blob_refs(registry):
    a = _create(registry, "ten_a", "one", sha="e" * 64)
    _create(registry, "ten_b", "two", sha="e" * 64)
    registry.mark_failed(a.id, "layer 7 q_proj lora_B has shape [576, 16], expected [576, 8]")
    assert registry.get(tenant_id="ten_a", adapter_id=a.id).reason.startswith("layer 7 q_proj")
    assert registry.num_blob_refs("e" * 64) == 1  # a failed record keeps its reason, not its blobs
    assert registry.live_blob_digests() == {"e" * 64, "c" * 64}
    registry.delete(tenant_id="ten_a", adapter_id=a.id)
    assert registry.num_blob_refs("e" * 64) == 1
    assert registry.find(a.id) is None


def test_bad_names_refused(registry):
    for bad in ["", "a:b", "../x", "x" * 65, " lead"]:
        with pytest.raises(InvalidRequestError, match="adapter name"):
            _create(registry, "ten_a", bad)
