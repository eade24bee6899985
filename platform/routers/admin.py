"""Operator routes (scope `admin`): tenants and their API keys."""

from __future__ import annotations

from fastapi import APIRouter
from loraplex.platform.api.strict_json import StrictJSONRoute
from loraplex.platform.auth import store
from loraplex.platform.deps import AdminKey, AppServices, DbSession
from loraplex.platform.errors import ConflictError, NotFoundError
from loraplex.platform.routers.admin_schemas import (
    ApiKeyCreate,
    ApiKeyCreated,
    ApiKeyPublic,
    TenantCreate,
    TenantPublic,
    TenantUpdate,
)

router = APIRouter(prefix="/v1/admin", tags=["admin"], route_class=StrictJSONRoute)


@router.post("/tenants", status_code=201)
def create_tenant(body: TenantCreate, _key: AdminKey, db: DbSession) -> TenantPublic:
    try:
        tenant = store.create_tenant(db, name=body.name, weight=body.weight)
    except store.TenantExistsError as exc:
        raise ConflictError(str(exc), param="name", code="tenant_exists") from None
    return TenantPublic.model_validate(tenant)


@router.get("/tenants")
def list_tenants(_key: AdminKey, db: DbSession) -> dict:
    return {"object": "list", "data": [TenantPublic.model_validate(t) for t in store.list_tenants(db)]}


@router.patch("/tenants/{tenant_id}")
def update_tenant(tenant_id: str, body: TenantUpdate, _key: AdminKey, db: DbSession, services: AppServices
                  ) -> TenantPublic:
    """A tenant's fair-sharing weight; this process's cached keys of the tenant pick it up at once."""
    tenant = store.set_tenant_weight(db, tenant_ref=tenant_id, weight=body.weight)
    if tenant is None:
        raise NotFoundError(f"no tenant '{tenant_id}'", param="tenant_id")
    for record in store.list_api_keys(db, tenant_id=tenant.id):
        services.key_cache.drop_entries(record.id)  # not forget_key: that revokes the key in every process
    return TenantPublic.model_validate(tenant)


@router.post("/tenants/{tenant_id}/keys", status_code=201)
def create_key(tenant_id: str, body: ApiKeyCreate, _key: AdminKey, db: DbSession) -> ApiKeyCreated:
    tenant = store.get_tenant(db, tenant_ref=tenant_id)
    if tenant is None:
        raise NotFoundError(f"no tenant '{tenant_id}'", param="tenant_id")
    created = store.create_api_key(
        db, tenant=tenant, scopes=body.scopes, name=body.name, rpm_limit=body.rpm_limit, tpm_limit=body.tpm_limit
    )
    return ApiKeyCreated.model_validate({**ApiKeyPublic.model_validate(created.record).model_dump(), "key": created.key})


@router.get("/tenants/{tenant_id}/keys")
def list_keys(tenant_id: str, _key: AdminKey, db: DbSession) -> dict:
    tenant = store.get_tenant(db, tenant_ref=tenant_id)
    if tenant is None:
        raise NotFoundError(f"no tenant '{tenant_id}'", param="tenant_id")
    keys = store.list_api_keys(db, tenant_id=tenant.id)
    return {"object": "list", "data": [ApiKeyPublic.model_validate(k) for k in keys]}


@router.delete("/keys/{key_id}")
def revoke_key(key_id: str, _key: AdminKey, db: DbSession, services: AppServices) -> ApiKeyPublic:
    record = store.revoke_api_key(db, key_id=key_id)
    if record is None:
        raise NotFoundError(f"no API key '{key_id}'", param="key_id")
    services.key_cache.forget_key(key_id)  # effective on this process's next request, not after the cache TTL
    return ApiKeyPublic.model_validate(record)
