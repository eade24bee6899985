"""Operator routes (scope `admin`) for the price book and monthly budgets.

Writes go to the database and invalidate this process's PriceBook / QuotaGuard
caches, so they apply here from the next request; other API processes see
them within the caches' TTLs (5 s for budgets; 30 s for the prices of the
quota's prompt-cost estimate; stored costs use the book as stored, always).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from loraplex.adapters.models import AdapterRecord
from loraplex.billing.budget_status import budget_status
from loraplex.billing.pricing import Price, list_prices, validate_new_price
from loraplex.billing.quotas import delete_budget, set_budget, validate_budget_limits
from loraplex.platform.api.strict_json import StrictJSONRoute
from loraplex.platform.auth import store
from loraplex.platform.db.models import ApiKey, Tenant
from loraplex.platform.deps import AdminKey, Billing, DbSession
from loraplex.platform.errors import NotFoundError
from loraplex.platform.routers.billing_schemas import BudgetUpdate, PriceCreate, PricePublic
from sqlalchemy.orm import Session

router = APIRouter(prefix="/v1/admin", tags=["admin", "billing"], route_class=StrictJSONRoute)


@router.get("/prices")
def get_prices(
    _key: AdminKey,
    db: DbSession,
    model: Annotated[str | None, Query(description="only this model's rows (* for the any-model rows)")] = None,
    adapter_id: Annotated[str | None, Query(description="only this adapter's rows")] = None,
) -> dict[str, Any]:
    rows = list_prices(db, model=model, adapter_id=adapter_id)
    return {"object": "list", "data": [PricePublic.of(price, in_force=now) for price, now in rows]}


@router.post("/prices", status_code=201)
def create_price(body: PriceCreate, _key: AdminKey, db: DbSession, billing: Billing) -> PricePublic:
    new = validate_new_price(
        model=body.model, adapter_id=body.adapter_id, input_usd=body.input, output_usd=body.output,
        cached_input_usd=body.cached_input, thinking_usd=body.thinking, effective_from=body.effective_from,
    )
    if new.adapter_id is not None and db.get(AdapterRecord, new.adapter_id) is None:
        raise NotFoundError(f"no adapter '{new.adapter_id}'", param="adapter_id")
    row = new.add_to(db)
    db.commit()
    if billing is not None:
        billing.price_book.invalidate()
    in_force = {price.id: now for price, now in list_prices(db, model=row.model, adapter_id=row.adapter_id)}
    return PricePublic.of(Price.from_row(row), in_force=in_force[row.id])


@router.get("/tenants/{tenant}/budgets")
def get_budgets(tenant: str, _key: AdminKey, db: DbSession, billing: Billing) -> dict[str, Any]:
    found = _tenant(db, tenant)
    return budget_status(db, tenant_id=found.id, guard=billing.guard if billing else None)


@router.put("/tenants/{tenant}/budgets")
def put_budget(tenant: str, body: BudgetUpdate, _key: AdminKey, db: DbSession, billing: Billing) -> dict[str, Any]:
    found = _tenant(db, tenant)
    tokens, cost = validate_budget_limits(
        monthly_token_limit=body.monthly_token_limit, monthly_cost_limit_usd=body.monthly_cost_limit_usd
    )
    if body.api_key_id is not None:
        _tenant_key(db, found, body.api_key_id)
    set_budget(db, tenant_id=found.id, api_key_id=body.api_key_id, monthly_token_limit=tokens,
               monthly_cost_limit_usd=cost)
    db.commit()
    if billing is not None:
        billing.guard.invalidate(found.id)
    status = budget_status(db, tenant_id=found.id, guard=billing.guard if billing else None,
                           api_key_ids=[body.api_key_id] if body.api_key_id else [])
    return next(b for b in status["data"] if b["api_key_id"] == body.api_key_id)


@router.delete("/tenants/{tenant}/budgets")
def remove_budget(
    tenant: str,
    _key: AdminKey,
    db: DbSession,
    billing: Billing,
    api_key_id: Annotated[str | None, Query(description="one key's budget; omit for the tenant's")] = None,
) -> dict[str, Any]:
    found = _tenant(db, tenant)
    if not delete_budget(db, tenant_id=found.id, api_key_id=api_key_id):
        who = f"API key '{api_key_id}'" if api_key_id else f"tenant '{found.name}' as a whole"
        raise NotFoundError(f"no budget for {who}", param="api_key_id" if api_key_id else "tenant")
    db.commit()
    if billing is not None:
        billing.guard.invalidate(found.id)
    return {"object": "budget.deleted", "tenant_id": found.id, "api_key_id": api_key_id, "deleted": True}


def _tenant(db: Session, ref: str) -> Tenant:
    found = store.get_tenant(db, tenant_ref=ref)
    if found is None:
        raise NotFoundError(f"no tenant '{ref}'", param="tenant")
    return found


def _tenant_key(db: Session, tenant: Tenant, key_id: str) -> ApiKey:
    key = db.get(ApiKey, key_id)
    if key is None or key.tenant_id != tenant.id:  # another tenant's key is as unknown as a missing one
        raise NotFoundError(f"tenant '{tenant.name}' has no API key '{key_id}'", param="api_key_id")
    return key
