"""/v1/adapters: upload (202, validated in the background), list, get, delete; plus the adapters wiring.

`install_adapters` builds the domain for one API process: blob store, SQL
registry, validation dispatcher (Celery over Redis when configured, else the
same task in a worker thread), the engine's LoRA manager fed from the store,
and the model resolver that turns `model=` into a tenant's adapter.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from loraplex.adapters.archive import UploadLimits
from loraplex.adapters.base_model import BaseModelSpec
from loraplex.adapters.errors import AdapterNotFoundError
from loraplex.adapters.models import AdapterStatus
from loraplex.adapters.registry import AdapterInfo, SqlAdapterRegistry, resolve_adapter, split_model_name
from loraplex.adapters.service import AdapterService, EngineAdapterHooks, StorageQuota
from loraplex.adapters.source import StoredAdapterSource
from loraplex.adapters.store import LocalBlobStore
from loraplex.adapters.sweep import StorageSweeper
from loraplex.adapters.tasks import CeleryValidationDispatcher, ThreadValidationDispatcher, make_job
from loraplex.adapters.upload_slots import TenantUploads
from loraplex.engine.config import AdapterLimits, ModelConfig
from loraplex.engine.core.client import EngineClient
from loraplex.platform.api.strict_json import StrictJSONRoute
from loraplex.platform.body_limit import declared_length
from loraplex.platform.deps import AdaptersKey, AppServices
from loraplex.platform.errors import NotFoundError
from loraplex.platform.extensions import Extensions, ServedModel
from loraplex.platform.settings import Settings
from sqlalchemy.orm import Session, sessionmaker
from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["adapters"], route_class=StrictJSONRoute)


def adapter_public(info: AdapterInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "object": "adapter",
        "name": info.name,
        "description": info.description,
        "status": info.status,
        "reason": info.reason,
        "rank": info.rank,
        "alpha": info.alpha,
        "target_modules": info.target_modules,
        "size_bytes": info.size_bytes,
        "sha256": info.sha256,
        "base_model": info.base_model,
        "created_at": int(info.created_at.timestamp()),
        "ready_at": int(info.ready_at.timestamp()) if info.ready_at else None,
    }


def _service(services: Any) -> AdapterService:
    return services.extensions.domain_state["adapters"].service


@router.post("/adapters", status_code=202)
async def upload_adapter(request: Request, key: AdaptersKey, services: AppServices) -> Response:
    length = request.headers.get("content-length")
    try:
        info = await _service(services).create_from_upload(
            tenant_id=key.tenant_id, chunks=request.stream(), content_type=request.headers.get("content-type", ""),
            content_length=declared_length(length),
        )
    except ClientDisconnect:
        # The client went away mid-upload: a normal abort, not a server error. The service has
        # already removed the staging folder; nothing was stored. Nobody reads this response.
        log.info("adapter upload aborted: the client disconnected")
        return Response(status_code=499)
    return JSONResponse(adapter_public(info), status_code=202)


@router.get("/adapters")
async def list_adapters(key: AdaptersKey, services: AppServices) -> dict:
    infos = await asyncio.to_thread(_service(services).registry.list, tenant_id=key.tenant_id)
    return {"object": "list", "data": [adapter_public(i) for i in infos]}


@router.get("/adapters/{adapter_id}")
async def get_adapter(adapter_id: str, key: AdaptersKey, services: AppServices) -> dict:
    info = await asyncio.to_thread(_service(services).registry.get, tenant_id=key.tenant_id, adapter_id=adapter_id)
    return adapter_public(info)


@router.delete("/adapters/{adapter_id}")
async def delete_adapter(adapter_id: str, key: AdaptersKey, services: AppServices) -> dict:
    info = await asyncio.to_thread(_service(services).delete, tenant_id=key.tenant_id, adapter_id=adapter_id)
    return {"id": info.id, "object": "adapter", "deleted": True}


class AdapterModelResolver:
    """`model` -> the base model or one of the tenant's ready adapters; /v1/models lists both."""

    def __init__(self, service: AdapterService, base_model_name: str) -> None:
        self.service = service
        self.base = ServedModel(id=base_model_name)

    async def list_models(self, tenant_id: str) -> list[ServedModel]:
        infos = await asyncio.to_thread(self.service.registry.list, tenant_id=tenant_id)
        adapters = [
            ServedModel(id=i.name, adapter_id=i.id, owned_by=tenant_id, created=int(i.created_at.timestamp()))
            for i in infos if i.status == AdapterStatus.READY
        ]
        return [self.base, *adapters]

    async def resolve(self, tenant_id: str, model: str) -> ServedModel:
        if split_model_name(model, self.base.id) is None:
            return self.base  # the base model needs no registry lookup, nor a thread hop for one
        try:
            info = await asyncio.to_thread(
                resolve_adapter, self.service.registry, tenant_id=tenant_id, model=model, base_model_id=self.base.id
            )
        except AdapterNotFoundError:
            raise NotFoundError(f"The model '{model}' does not exist", param="model", code="model_not_found") from None
        if info is None:
            return self.base
        return ServedModel(id=info.name, adapter_id=info.id, owned_by=tenant_id,
                           created=int(info.created_at.timestamp()))


@dataclass(slots=True)
class AdaptersDomain:
    service: AdapterService
    handle: Any  # what engine.attach_adapters returned; None where the engine-core process serves its own source


def install_adapters(
    extensions: Extensions, settings: Settings, *, engine: EngineClient, db_sessions: sessionmaker[Session],
    base_model_name: str, limits: UploadLimits | None = None,
) -> AdaptersDomain:
    """Build the adapters domain and hook it into the extensions and the engine."""
    storage = settings.resolved_adapter_storage_dir
    store = LocalBlobStore(storage)
    registry = SqlAdapterRegistry(db_sessions)
    dtype_name = settings.resolve_dtype()
    spec = base_model_spec(settings, engine.model_config, base_model_name)
    limits = limits or UploadLimits.from_settings(settings)
    job = make_job(database_url=settings.resolved_database_url, storage_dir=storage, spec=spec,
                   max_rank=settings.max_lora_rank, dtype=dtype_name, limits=limits)
    if settings.redis_url:
        from loraplex.platform.celery_app import make_celery

        dispatcher: Any = CeleryValidationDispatcher(make_celery(settings), job)
    else:
        dispatcher = ThreadValidationDispatcher(job=job)
    source = StoredAdapterSource(registry, store, spec, getattr(torch, dtype_name))
    # The engine-core process built this same source from these settings at start-up (before capturing its decode
    # graphs); its API servers share it rather than each replacing it in turn.
    handle = None if settings.engine_core_address else engine.attach_adapters(source, adapter_limits(settings))
    hooks = EngineAdapterHooks(is_in_use=engine.adapter_in_use, evict=engine.evict_adapter)
    quota = StorageQuota(max_bytes=settings.adapter_quota_bytes_per_tenant or None,
                         max_adapters=settings.adapter_quota_count_per_tenant or None)
    service = AdapterService(registry=registry, store=store, dispatcher=dispatcher, staging_root=storage / "staging",
                             limits=limits, hooks=hooks, quota=quota,
                             uploads=TenantUploads(settings.max_concurrent_uploads_per_tenant))
    sweeper = StorageSweeper(registry, store, storage / "staging", interval_s=settings.adapter_sweep_interval_s,
                             min_age_s=settings.adapter_sweep_min_age_s)
    sweeper.start()
    domain = AdaptersDomain(service=service, handle=handle)
    extensions.domain_state["adapters"] = domain
    extensions.model_resolver = AdapterModelResolver(service, base_model_name)

    async def stop() -> None:
        await asyncio.to_thread(sweeper.stop)
        if isinstance(dispatcher, ThreadValidationDispatcher):
            await asyncio.to_thread(dispatcher.shutdown)
        if handle is not None:
            engine.detach_adapters(handle)

    extensions.on_shutdown.append(stop)
    return domain


def base_model_spec(settings: Settings, model_config: ModelConfig, base_model_name: str) -> BaseModelSpec:
    aliases = (settings.model_path.name,) if settings.model_path is not None else ()
    return BaseModelSpec.from_model_config(model_config, name=base_model_name, aliases=aliases)


def stored_adapter_source(settings: Settings, *, db_sessions: sessionmaker[Session], model_config: ModelConfig,
                          base_model_name: str) -> StoredAdapterSource:
    """Where the engine loads adapters from (the engine-core process builds its own with this)."""
    return StoredAdapterSource(SqlAdapterRegistry(db_sessions), LocalBlobStore(settings.resolved_adapter_storage_dir),
                               base_model_spec(settings, model_config, base_model_name),
                               getattr(torch, settings.resolve_dtype()))


def adapter_limits(settings: Settings) -> AdapterLimits:
    return AdapterLimits(max_loras=settings.max_loras, max_cpu_loras=settings.max_cpu_loras,
                         max_lora_rank=settings.max_lora_rank)
