"""GET /v1/usage: the caller's usage by day, model, adapter or API key, as JSON or CSV.

Scope `usage` reads the key's own tenant; an `admin` key may name any tenant
with `tenant_id` (or `*` for every tenant). GET /v1/usage/budgets: the
caller's monthly budgets (the tenant's and the calling key's own) with spend.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response
from fastapi.responses import JSONResponse
from loraplex.billing.budget_status import budget_status
from loraplex.billing.reports import ReportQuery, report_csv, report_json, usage_report
from loraplex.platform.auth.scopes import Scope
from loraplex.platform.deps import AppServices, Billing, CurrentKey, UsageKey
from loraplex.platform.errors import PermissionDeniedError

router = APIRouter(prefix="/v1", tags=["usage"])

ALL_TENANTS = "*"


@router.get("/usage")
async def get_usage(
    key: CurrentKey,
    services: AppServices,
    start: Annotated[str | None, Query(description="first day, YYYY-MM-DD (default: first of this month)")] = None,
    end: Annotated[str | None, Query(description="last day, inclusive (default: today, UTC)")] = None,
    group_by: Annotated[str, Query(description="day, model, adapter, api_key (comma-separated)")] = "day",
    format: Annotated[Literal["json", "csv"], Query()] = "json",
    tenant_id: Annotated[str | None, Query(description="admins only: another tenant, or * for all")] = None,
) -> Response:
    is_admin = Scope.ADMIN.value in key.scopes
    if not is_admin and Scope.USAGE.value not in key.scopes:
        raise PermissionDeniedError(f"this API key lacks the '{Scope.USAGE.value}' scope")
    target = key.tenant_id
    if tenant_id is not None and tenant_id != key.tenant_id:
        if not is_admin:
            raise PermissionDeniedError("only admin keys may read another tenant's usage", code="not_admin")
        target = None if tenant_id == ALL_TENANTS else tenant_id
    query = ReportQuery.parse(start=start, end=end, group_by=group_by, tenant_id=target)

    def run() -> list[dict]:
        with services.db_sessions() as session:
            return usage_report(session, query)

    rows = await asyncio.to_thread(run)
    if format == "csv":
        name = f"usage-{target or 'all'}-{query.start.isoformat()}-{query.end.isoformat()}.csv"
        return Response(
            report_csv(query, rows), media_type="text/csv; charset=utf-8",
            headers={"Content-Disposition": f'attachment; filename="{name}"'},
        )
    return JSONResponse(report_json(query, rows))


@router.get("/usage/budgets")
async def get_budgets(key: UsageKey, services: AppServices, billing: Billing) -> dict:
    """Same shape as the admin view, limited to what this key answers to: never other keys' budgets."""

    def run() -> dict:
        with services.db_sessions() as session:
            return budget_status(session, tenant_id=key.tenant_id, guard=billing.guard if billing else None,
                                 api_key_ids=[key.key_id])

    return await asyncio.to_thread(run)
