"""A tenant's budgets with this month's spend: the one JSON shape the admin API, the tenant API and the CLI show.

Spend comes from the QuotaGuard's counters when the serving process has one
(they are what `check` enforces), else from the ledger (the CLI, or metering
off), which the counters are reconciled from anyway.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import UTC, datetime
from typing import Any

from loraplex.billing.models import BudgetRow
from loraplex.billing.pricing import picousd_to_usd, usd_text
from loraplex.billing.quotas import WHOLE_TENANT, QuotaGuard, Spend, ledger_spend, month_bounds, month_of
from sqlalchemy import select
from sqlalchemy.orm import Session


def budget_status(
    session: Session,
    *,
    tenant_id: str,
    guard: QuotaGuard | None,
    api_key_ids: Collection[str] | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """The tenant-wide budget and the keys' budgets (all of them, or only `api_key_ids`), with spend."""
    month = month_of(now or datetime.now(UTC))
    resets_on = month_bounds(month)[1].isoformat()
    query = select(BudgetRow).where(BudgetRow.tenant_id == tenant_id)
    if api_key_ids is not None:
        query = query.where(BudgetRow.api_key_id.in_([WHOLE_TENANT, *api_key_ids]))
    rows = sorted(session.scalars(query), key=lambda row: (row.api_key_id != WHOLE_TENANT, row.api_key_id))
    from_ledger = ledger_spend(session, month=month, tenant_id=tenant_id) if guard is None and rows else {}

    def spend_of(scope: str) -> Spend:
        if guard is not None:
            return guard.spend(tenant_id=tenant_id, api_key_id=scope or None, month=month)
        return from_ledger.get((tenant_id, scope), Spend())

    data = []
    for row in rows:
        spend = spend_of(row.api_key_id)
        tokens_left = None if row.monthly_token_limit is None else max(row.monthly_token_limit - spend.tokens, 0)
        cost_limit = row.monthly_cost_limit_picousd
        cost_left = None if cost_limit is None else max(cost_limit - spend.cost_picousd, 0)
        data.append({
            "object": "budget",
            "scope": "tenant" if row.api_key_id == WHOLE_TENANT else "api_key",
            "api_key_id": row.api_key_id or None,
            "monthly_token_limit": row.monthly_token_limit,
            "monthly_cost_limit_usd": None if cost_limit is None else usd_text(picousd_to_usd(cost_limit)),
            "used_tokens": spend.tokens,
            "used_cost_usd": usd_text(picousd_to_usd(spend.cost_picousd)),
            "remaining_tokens": tokens_left,
            "remaining_cost_usd": None if cost_left is None else usd_text(picousd_to_usd(cost_left)),
            "resets_on": resets_on,
            "updated_at": _utc(row.updated_at).isoformat(),
        })
    return {"object": "list", "tenant_id": tenant_id, "month": month, "resets_on": resets_on, "data": data}


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)  # SQLite returns naive UTC
