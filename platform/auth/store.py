"""Keyword-only data functions for tenants and API keys (used by the admin API and the CLI)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from loraplex.platform.auth.keys import display_prefix, generate_api_key, hash_api_key
from loraplex.platform.auth.scopes import Scope
from loraplex.platform.db.base import utcnow
from loraplex.platform.db.models import ApiKey, Tenant
from sqlalchemy import select
from sqlalchemy.orm import Session


class TenantExistsError(ValueError):
    pass


@dataclass(slots=True)
class CreatedKey:
    """The only moment the full key exists outside the caller's hands."""

    record: ApiKey
    key: str


# A tenant's weight in the engine's fair sharing: bounded so one tenant's share can never round the others' to 0.
MIN_TENANT_WEIGHT, MAX_TENANT_WEIGHT = 0.01, 100.0


def create_tenant(db: Session, *, name: str, weight: float = 1.0) -> Tenant:
    if db.scalar(select(Tenant).where(Tenant.name == name)) is not None:
        raise TenantExistsError(f"tenant {name!r} already exists")
    tenant = Tenant(id="ten_" + secrets.token_hex(8), name=name, created_at=utcnow(), weight=weight)
    db.add(tenant)
    db.commit()
    return tenant


def set_tenant_weight(db: Session, *, tenant_ref: str, weight: float) -> Tenant | None:
    """The tenant's weight in fair sharing; its keys carry the new weight once the key cache refreshes them."""
    tenant = get_tenant(db, tenant_ref=tenant_ref)
    if tenant is None:
        return None
    tenant.weight = weight
    db.commit()
    return tenant


def list_tenants(db: Session) -> list[Tenant]:
    return list(db.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.id)))


def get_tenant(db: Session, *, tenant_ref: str) -> Tenant | None:
    """By id or by name (the CLI accepts either)."""
    return db.get(Tenant, tenant_ref) or db.scalar(select(Tenant).where(Tenant.name == tenant_ref))


def create_api_key(
    db: Session,
    *,
    tenant: Tenant,
    scopes: list[Scope],
    name: str = "",
    rpm_limit: int | None = None,
    tpm_limit: int | None = None,
) -> CreatedKey:
    key = generate_api_key()
    record = ApiKey(
        id="key_" + secrets.token_hex(8),
        tenant_id=tenant.id,
        name=name,
        key_hash=hash_api_key(key),
        key_prefix=display_prefix(key),
        scopes=" ".join(scope.value for scope in scopes),
        rpm_limit=rpm_limit,
        tpm_limit=tpm_limit,
        created_at=utcnow(),
    )
    db.add(record)
    db.commit()
    return CreatedKey(record=record, key=key)


def list_api_keys(db: Session, *, tenant_id: str | None = None) -> list[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
    if tenant_id is not None:
        query = query.where(ApiKey.tenant_id == tenant_id)
    return list(db.scalars(query))


def revoke_api_key(db: Session, *, key_id: str, tenant_id: str | None = None) -> ApiKey | None:
    """Revoke by id (optionally only within one tenant); None if there is no such key."""
    record = db.get(ApiKey, key_id)
    if record is None or (tenant_id is not None and record.tenant_id != tenant_id):
        return None
    if record.revoked_at is None:
        record.revoked_at = utcnow()
        db.commit()
    return record


def authenticate(db: Session, *, key: str, last_used_resolution_s: float) -> ApiKey | None:
    """The live key record for `key`, or None (unknown or revoked). Touches last_used_at."""
    record = db.scalar(select(ApiKey).where(ApiKey.key_hash == hash_api_key(key)))
    if record is None or record.is_revoked:
        return None
    now = utcnow()
    # Writing on every request would serialise all requests on one row; a coarse timestamp is enough.
    if record.last_used_at is None or _as_aware(record.last_used_at) < now - timedelta(seconds=last_used_resolution_s):
        record.last_used_at = now
        db.commit()
    return record


def _as_aware(moment: datetime) -> datetime:
    # SQLite returns naive datetimes even for timezone-aware columns; we only ever store UTC.
    return moment if moment.tzinfo else moment.replace(tzinfo=utcnow().tzinfo)
