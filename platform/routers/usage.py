"""GET /v1/usage: the caller's usage by day, model, adapter, API key or end user, as JSON or CSV.

Scope `usage` reads the key's own tenant; an `admin` key may name any tenant
with `tenant_id` (or `*` for every tenant). GET /v1/usage/requests: the
per-request log (what each request was charged), one tenant at a time;
GET /v1/usage/requests/{request_id} one request, by its x-request-id.
GET /v1/usage/budgets: the caller's monthly budgets (the tenant's and the
calling key's own) with spend.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response
from fastapi.responses import JSONResponse
from loraplex.billing.budget_status import budget_status
from loraplex.billing.reports import ReportQuery, report_csv, report_json, usage_report
from loraplex.billing.request_log import (
    RequestLogQuery,
    RequestPage,
    get_request,
    list_requests,
    requests_csv,
)
from loraplex.engine.errors import InvalidRequestError
from loraplex.platform.api.strict_json import StrictJSONRoute
from loraplex.platform.auth.scopes import Scope
from loraplex.platform.deps import AppServices, Billing, CurrentKey, Principal, UsageKey
from loraplex.platform.errors import NotFoundError, PermissionDeniedError

LOOKUP_WAIT_S = 3.0

router = APIRouter(prefix="/v1", tags=["usage"], route_class=StrictJSONRoute)

ALL_TENANTS = "*"


def usage_tenant(key: Principal, tenant_id: str | None) -> str | None:
    """The tenant whose usage this key may read: its own (scope `usage`), any (`admin`); None: every tenant."""
    is_admin = Scope.ADMIN.value in key.scopes
    if not is_admin and Scope.USAGE.value not in key.scopes:
        raise PermissionDeniedError(f"this API key lacks the '{Scope.USAGE.value}' scope")
    if tenant_id is None or tenant_id == key.tenant_id:
        return key.tenant_id
    if not is_admin:
        raise PermissionDeniedError("only admin keys may read another tenant's usage", code="not_admin")
    return None if tenant_id == ALL_TENANTS else tenant_id


def one_tenant(key: Principal, tenant_id: str | None) -> str:
    """As usage_tenant, but the per-request log never spans tenants."""
    target = usage_tenant(key, tenant_id)
    if target is None:
        raise InvalidRequestError("the request log covers one tenant: name it, not '*'", param="tenant_id")
    return target


def csv_download(body: str, filename: str) -> Response:
    return Response(body, media_type="text/csv; charset=utf-8",
                    headers={"Content-Disposition": f'attachment; filename="{filename}"'})


@router.get("/usage")
async def get_usage(
    key: CurrentKey,
    services: AppServices,
    start: Annotated[str | None, Query(description="first day, YYYY-MM-DD (default: first of this month)")] = None,
    end: Annotated[str | None, Query(description="last day, inclusive (default: today, UTC)")] = None,
    group_by: Annotated[str, Query(description="day, model, adapter, api_key, user (comma-separated)")] = "day",
    format: Annotated[Literal["json", "csv"], Query()] = "json",
    tenant_id: Annotated[str | None, Query(description="admins only: another tenant, or * for all")] = None,
) -> Response:
    target = usage_tenant(key, tenant_id)
    query = ReportQuery.parse(start=start, end=end, group_by=group_by, tenant_id=target)

    def run() -> str:  # the query and the rendering, off the event loop
        with services.db_sessions() as session:
            rows = usage_report(session, query, max_rows=services.settings.usage_report_max_rows)
        if format == "csv":
            return report_csv(query, rows)
        return json.dumps(report_json(query, rows), ensure_ascii=False, allow_nan=False, separators=(",", ":"))

    body = await asyncio.to_thread(run)
    if format == "csv":
        return csv_download(body, f"usage-{target or 'all'}-{query.start}-{query.end}.csv")
    return Response(body, media_type="application/json")


@router.get("/usage/requests")
async def get_usage_requests(
    key: CurrentKey,
    services: AppServices,
    start: Annotated[str | None, Query(description="first day, YYYY-MM-DD (default: first of this month)")] = None,
    end: Annotated[str | None, Query(description="last day, inclusive (default: today, UTC)")] = None,
    api_key_id: Annotated[str | None, Query()] = None,
    model: Annotated[str | None, Query()] = None,
    adapter_id: Annotated[str | None, Query(description="an adapter id, or 'base' for the base model")] = None,
    session_id: Annotated[str | None, Query()] = None,
    user: Annotated[str | None, Query(description="the `user` the requests sent (the caller's end user)")] = None,
    status: Annotated[str | None, Query(description="completed, stopped, length, aborted or failed")] = None,
    limit: Annotated[str | None, Query(description="rows per page, 1-1000 (default 100)")] = None,
    cursor: Annotated[str | None, Query(description="next_cursor of the previous page")] = None,
    format: Annotated[Literal["json", "csv"], Query()] = "json",
    tenant_id: Annotated[str | None, Query(description="admins only: another tenant")] = None,
) -> Response:
    """One request per row, newest first, with its cost; totals cover every row the filters match."""
    target = one_tenant(key, tenant_id)
    query = RequestLogQuery.parse(tenant_id=target, start=start, end=end, api_key_id=api_key_id, model=model,
                                  adapter_id=adapter_id, session_id=session_id, user=user, status=status, limit=limit,
                                  cursor=cursor)

    def run() -> RequestPage:
        with services.db_sessions() as session:
            return list_requests(session, query)

    page = await asyncio.to_thread(run)
    if format == "csv":
        return csv_download(requests_csv(page.rows), f"requests-{target}-{query.start}-{query.end}.csv")
    return JSONResponse({"object": "list", "data": page.rows, "has_more": page.has_more,
                         "next_cursor": page.next_cursor, "totals": page.totals})


@router.get("/usage/requests/{request_id}")
async def get_usage_request(
    request_id: str,
    key: CurrentKey,
    services: AppServices,
    billing: Billing,
    tenant_id: Annotated[str | None, Query(description="admins only: another tenant")] = None,
) -> dict:
    """One request by its x-request-id; another tenant's id is as unknown as a made-up one."""
    target = one_tenant(key, tenant_id)

    def run() -> dict | None:
        with services.db_sessions() as session:
            return get_request(session, tenant_id=target, request_id=request_id)

    row = await asyncio.to_thread(run)
    # A request this process just answered may still be on its way to the ledger: wait briefly for the
    # meter's writer, so looking up the x-request-id a response carried works at once. Only for an id it
    # recorded: a made-up one would hold a worker thread for the whole wait.
    meter = billing.meter if billing is not None and row is None else None
    if meter is not None and meter.recorded_recently(request_id) and await asyncio.to_thread(
            meter.wait_written, LOOKUP_WAIT_S):
        row = await asyncio.to_thread(run)
    if row is None:
        raise NotFoundError(
            f"no request '{request_id}' in this tenant's usage; a request that just finished reaches the ledger "
            "within about a second, so retry shortly if it is yours", param="request_id")
    return {"object": "usage.request", **row}


@router.get("/usage/budgets")
async def get_budgets(key: UsageKey, services: AppServices, billing: Billing) -> dict:
    """Same shape as the admin view, limited to what this key answers to: never other keys' budgets."""

    def run() -> dict:
        with services.db_sessions() as session:
            return budget_status(session, tenant_id=key.tenant_id, guard=billing.guard if billing else None,
                                 api_key_ids=[key.key_id])

    return await asyncio.to_thread(run)
