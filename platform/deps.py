"""FastAPI dependencies as `Annotated` aliases: `DbSession`, `CurrentKey`, scope-checked keys.

Routes declare what they need (`key: InferenceKey`, `db: DbSession`) and stay thin.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from loraplex.platform.auth.keys import hash_api_key
from loraplex.platform.auth.scopes import Scope
from loraplex.platform.auth.store import authenticate
from loraplex.platform.db.models import ApiKey
from loraplex.platform.errors import AuthenticationError, DependencyUnavailableError, PermissionDeniedError
from loraplex.platform.metering import BillingDomain
from loraplex.platform.ratelimit.limiter import Limits
from loraplex.platform.services import Services
from loraplex.platform.settings import Settings
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

# What a stopped or unreachable database raises (connect refused, connection lost, pool timeout).
DB_UNAVAILABLE_ERRORS = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError,
                         sa_exc.TimeoutError)


@dataclass(slots=True, frozen=True)
class Principal:
    """Who is calling: a live API key of one tenant. Plain values, safe to keep past the DB session."""

    key_id: str
    tenant_id: str
    scopes: frozenset[str]
    limits: Limits
    tenant_weight: float = 1.0  # the tenant's weight in the engine's fair sharing


# Every dependency on the request path is `async def`: FastAPI runs a plain `def` dependency in its thread
# pool, one thread hop (and a GIL hand-off) each, and an inference request had three of them (services, key,
# scope) before its handler ran. Only the key store's I/O, on a cache miss, goes to a thread.
async def get_services(request: Request) -> Services:
    return request.app.state.services


AppServices = Annotated[Services, Depends(get_services)]


async def get_billing(services: AppServices) -> BillingDomain | None:
    """The serving process's quota guard and price book; None when metering is off."""
    return services.extensions.domain_state.get("billing")


Billing = Annotated[BillingDomain | None, Depends(get_billing)]


def get_db(services: AppServices) -> Iterator[Session]:
    with services.db_sessions() as session:
        yield session


# scope="function": the session closes when the route returns, not when a long stream ends.
DbSession = Annotated[Session, Depends(get_db, scope="function")]


async def get_current_key(request: Request) -> Principal:
    return await authenticate_request(request, request.app.state.services)


async def authenticate_request(request: Request, services: Services) -> Principal:
    """The caller's live API key; from this process's cache when fresh (no thread, no database)."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        raise AuthenticationError(
            "missing API key: send it as 'Authorization: Bearer lpx_...'", code="missing_api_key"
        )
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthenticationError("malformed Authorization header: expected 'Bearer <API key>'")
    key_hash = hash_api_key(token)
    cached = services.key_cache.fresh(key_hash)
    if cached is not None:
        return cached
    try:
        principal = await asyncio.to_thread(_look_up_key, services, token)
    except DB_UNAVAILABLE_ERRORS as exc:
        stale = services.key_cache.stale(key_hash)
        if stale is not None:
            log.warning("database unreachable (%s); serving key %s from the cache", type(exc).__name__, stale.key_id)
            return stale
        raise DependencyUnavailableError("the key store is unreachable; try again shortly") from exc
    if principal is None:
        raise AuthenticationError("invalid or revoked API key")
    services.key_cache.put(key_hash, principal.key_id, principal)
    return principal


def _look_up_key(services: Services, token: str) -> Principal | None:
    """The key store's answer for `token` (None: unknown or revoked); runs in a worker thread."""
    settings = services.settings
    with services.db_sessions() as db:
        record = authenticate(db, key=token, last_used_resolution_s=settings.key_last_used_resolution_s)
        return None if record is None else _principal(record, settings)


def _principal(record: ApiKey, settings: Settings) -> Principal:
    limits = Limits(
        rpm=record.rpm_limit if record.rpm_limit is not None else settings.default_rpm,
        tpm=record.tpm_limit if record.tpm_limit is not None else settings.default_tpm,
    )
    return Principal(key_id=record.id, tenant_id=record.tenant_id, scopes=record.scope_set, limits=limits,
                     tenant_weight=record.tenant.weight)


CurrentKey = Annotated[Principal, Depends(get_current_key)]


def require_scope(scope: Scope) -> Callable[[Request], Awaitable[Principal]]:
    """One dependency (of the request alone) that authenticates and checks the scope: FastAPI resolves each
    dependency of a dependency separately, and the generation routes pay that on every request."""
    async def check(request: Request) -> Principal:
        key = await authenticate_request(request, request.app.state.services)
        if scope.value not in key.scopes:
            raise PermissionDeniedError(f"this API key lacks the '{scope.value}' scope")
        return key

    return check


InferenceKey = Annotated[Principal, Depends(require_scope(Scope.INFERENCE))]
AdaptersKey = Annotated[Principal, Depends(require_scope(Scope.ADAPTERS))]
UsageKey = Annotated[Principal, Depends(require_scope(Scope.USAGE))]
AdminKey = Annotated[Principal, Depends(require_scope(Scope.ADMIN))]
