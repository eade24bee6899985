"""Monthly budgets per tenant and per API key, held under concurrency by reservations.

Spending lives in counters keyed by UTC month (Redis hashes when Redis is
configured, database rows otherwise: billing/budget_counters.py), so a new
month starts from zero by itself. Admission `reserve`s a request's maximum
cost (its prompt plus every choice's max_tokens, at the prices in force)
atomically with the check: a request is admitted while recorded spend plus
outstanding reservations is under the limit, so concurrent requests overspend
a budget by at most one request's reservation. `settle` (the meter's callback,
once the ledger first stores the request's event) swaps the reservation for
the actual usage in the same atomic step. A reservation whose request never
settles (a crashed server) lapses after its TTL. `reconcile` resets the
recorded spend from the ledger (at start-up without Redis, and from the beat
task), which repairs anything a Redis restart or a crash lost.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from datetime import UTC, datetime
from decimal import Decimal

from loraplex.billing.budget_types import (
    WHOLE_TENANT,
    Budget,
    Refusal,
    ScopeHold,
    Settlement,
    Spend,
    SpendCounter,
    month_bounds,
    month_of,
)
from loraplex.billing.events import UsageEvent
from loraplex.billing.ledger import UNAVAILABLE_ERRORS
from loraplex.billing.models import BudgetRow, UsageEventRow
from loraplex.billing.pricing import parse_usd, picousd_to_usd, usd_to_picousd
from loraplex.billing.spend_counters import MemorySpendCounter, RedisSpendCounter
from loraplex.engine.errors import DomainError, InvalidRequestError
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

MAX_TOKEN_LIMIT = 2**63 - 1  # a 64-bit column

__all__ = [  # the counters and values are re-exported: callers name them from here
    "WHOLE_TENANT", "Budget", "MemorySpendCounter", "QuotaExceededError", "QuotaGuard", "RedisSpendCounter",
    "Spend", "SpendCounter", "delete_budget", "ledger_spend", "month_bounds", "month_of", "set_budget",
    "validate_budget_limits",
]


class QuotaExceededError(DomainError):
    """The tenant's or key's monthly budget is spent (the platform answers 429, as OpenAI does)."""

    code = "insufficient_quota"


def ledger_spend(session: Session, *, month: str, tenant_id: str | None = None) -> dict[tuple[str, str], Spend]:
    """The month's spend from the ledger per (tenant, scope): WHOLE_TENANT and each API key."""
    first, following = month_bounds(month)
    e = UsageEventRow
    query = (
        select(e.tenant_id, e.api_key_id, func.sum(e.input_tokens + e.output_tokens), func.sum(e.cost_picousd))
        .where(e.day >= first, e.day < following)
        .group_by(e.tenant_id, e.api_key_id)
    )
    if tenant_id is not None:
        query = query.where(e.tenant_id == tenant_id)
    per_scope: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for tenant, key, tokens, cost in session.execute(query):
        for scope in {WHOLE_TENANT, key or WHOLE_TENANT}:
            per_scope[tenant, scope][0] += int(tokens or 0)
            per_scope[tenant, scope][1] += int(cost or 0)
    return {where: Spend(tokens, cost) for where, (tokens, cost) in per_scope.items()}


class QuotaGuard:
    def __init__(
        self, session_factory: sessionmaker[Session], counter: SpendCounter, *, budget_cache_s: float = 5.0,
        reservation_ttl_s: float = 900.0,
    ) -> None:
        self._session_factory = session_factory
        self._counter = counter
        self._cache_s = budget_cache_s
        self._reservation_ttl_s = reservation_ttl_s
        self._budgets: dict[str, tuple[float, dict[str, Budget]]] = {}

    def check(self, *, tenant_id: str, api_key_id: str | None, estimated_tokens: int = 0,
              estimated_cost_picousd: int = 0, now: datetime | None = None) -> None:
        """Raise QuotaExceededError if the tenant's or the key's monthly budget is spent, or if a request
        of at least `estimated_tokens` tokens costing at least `estimated_cost_picousd` would overrun it.

        Estimates are lower bounds (the prompt, before any output), so only a request that certainly
        cannot fit is refused.
        """
        budgets = self._tenant_budgets(tenant_id)
        if not budgets:
            return
        month = month_of(now or datetime.now(UTC))
        scopes = [(WHOLE_TENANT, f"tenant {tenant_id}")]
        if api_key_id:
            scopes.append((api_key_id, f"API key {api_key_id}"))
        for scope, who in scopes:
            budget = budgets.get(scope)
            if budget is None:
                continue
            spend = self._counter.get(month, tenant_id, scope)
            resets = month_bounds(month)[1].isoformat()
            limit = budget.token_limit
            if limit is not None and (spend.tokens >= limit or spend.tokens + estimated_tokens > limit):
                used = f"{spend.tokens:,} of {limit:,} tokens used in {month}"
                raise QuotaExceededError(
                    f"The monthly token budget of {who} is spent: {used}. It resets on {resets}."
                    if spend.tokens >= limit else
                    f"This request's {estimated_tokens:,} prompt tokens would overrun the monthly token budget of "
                    f"{who}: {used}, {limit - spend.tokens:,} left. It resets on {resets}."
                )
            limit = budget.cost_limit_picousd
            if limit is not None and (spend.cost_picousd >= limit or spend.cost_picousd + estimated_cost_picousd > limit):
                used = (f"${picousd_to_usd(spend.cost_picousd):.6f} of ${picousd_to_usd(limit):.2f} "
                        f"used in {month}")
                raise QuotaExceededError(
                    f"The monthly cost budget of {who} is spent: {used}. It resets on {resets}."
                    if spend.cost_picousd >= limit else
                    f"This request's prompt (at least ${picousd_to_usd(estimated_cost_picousd):.6f}) would overrun "
                    f"the monthly cost budget of {who}: {used}. It resets on {resets}."
                )

    def is_known_unlimited(self, tenant_id: str) -> bool:
        """True when the cached budgets say this tenant has none: `check` would do no I/O and pass."""
        cached = self._budgets.get(tenant_id)
        return cached is not None and not cached[1] and time.monotonic() - cached[0] < self._cache_s

    def reserve(self, *, request_id: str, tenant_id: str, api_key_id: str | None, amount: Spend,
                floor: Spend, now: datetime | None = None) -> bool:
        """Hold `amount` (the request's maximum cost) on the tenant's and the key's budgets, or raise
        QuotaExceededError. `floor` is what the request certainly costs (its prompt): one that cannot fit
        even that is refused although the budget is not used up. False when no budget applies."""
        budgets = self._tenant_budgets(tenant_id)
        named = [(WHOLE_TENANT, f"tenant {tenant_id}")]
        if api_key_id:
            named.append((api_key_id, f"API key {api_key_id}"))
        holds = [ScopeHold(scope, budgets[scope]) for scope, _ in named if scope in budgets]
        if not holds:
            return False
        moment = now or datetime.now(UTC)
        month = month_of(moment)
        try:
            refusal = self._counter.reserve(
                month=month, tenant_id=tenant_id, request_id=request_id, holds=holds, amount=amount, floor=floor,
                expires_at=moment.timestamp() + self._reservation_ttl_s, now=moment.timestamp(),
            )
        except UNAVAILABLE_ERRORS:
            # The budget store being down must not stop inference: admit, unreserved (the ledger still bills it).
            log.warning("budget store unavailable; request %s admitted without a reservation", request_id)
            return False
        if refusal is not None:
            who = dict(named)[refusal.scope]
            raise QuotaExceededError(_refusal_message(refusal, budgets[refusal.scope], who, month, floor))
        return True

    def settle(self, events: list[UsageEvent], costs: dict[str, int]) -> None:
        """Meter callback, for events the ledger stored for the first time: each replaces its request's
        reservation with what it actually cost."""
        self._counter.settle([
            Settlement(month=month_of(event.created_at), tenant_id=event.tenant_id,
                       scopes=tuple({WHOLE_TENANT, event.api_key_id or WHOLE_TENANT}), request_id=event.request_id,
                       actual=Spend(event.total_tokens, costs.get(event.request_id, 0)))
            for event in events
        ])

    on_recorded = settle

    def release(self, *, request_id: str, tenant_id: str, api_key_id: str | None) -> None:
        """Drop a reservation whose request was refused after it was made (by a later admission check)."""
        self._counter.settle([Settlement(month=month_of(datetime.now(UTC)), tenant_id=tenant_id,
                                         scopes=tuple({WHOLE_TENANT, api_key_id or WHOLE_TENANT}),
                                         request_id=request_id, actual=Spend())])

    def reconcile(self, *, month: str | None = None, tenant_id: str | None = None) -> int:
        """Reset the month's counters from the ledger; returns how many counters were set."""
        month = month or month_of(datetime.now(UTC))
        with self._session_factory() as session:
            per_scope = ledger_spend(session, month=month, tenant_id=tenant_id)
        for (tenant, scope), spend in per_scope.items():
            self._counter.set(month, tenant, scope, spend)
        return len(per_scope)

    def spend(self, *, tenant_id: str, api_key_id: str | None = None, month: str | None = None) -> Spend:
        return self._counter.get(month or month_of(datetime.now(UTC)), tenant_id, api_key_id or WHOLE_TENANT)

    def invalidate(self, tenant_id: str | None = None) -> None:
        if tenant_id is None:
            self._budgets.clear()
        else:
            self._budgets.pop(tenant_id, None)

    def _tenant_budgets(self, tenant_id: str) -> dict[str, Budget]:
        cached = self._budgets.get(tenant_id)
        if cached is not None and time.monotonic() - cached[0] < self._cache_s:
            return cached[1]
        try:
            with self._session_factory() as session:
                rows = session.scalars(select(BudgetRow).where(BudgetRow.tenant_id == tenant_id)).all()
        except UNAVAILABLE_ERRORS:
            # The database being down must not stop inference: keep the last known budgets.
            log.warning("budgets for %s unavailable; using the cached ones", tenant_id)
            return cached[1] if cached else {}
        budgets = {row.api_key_id: Budget(row.monthly_token_limit, row.monthly_cost_limit_picousd) for row in rows}
        self._budgets[tenant_id] = (time.monotonic(), budgets)
        return budgets


def _refusal_message(refusal: Refusal, budget: Budget, who: str, month: str, floor: Spend) -> str:
    resets = month_bounds(month)[1].isoformat()
    used = refusal.used
    if not refusal.by_cost:
        limit = budget.token_limit or 0
        spent = f"{used.tokens:,} of {limit:,} tokens used or held by running requests in {month}"
        if used.tokens >= limit:
            return f"The monthly token budget of {who} is spent: {spent}. It resets on {resets}."
        return (f"This request's {floor.tokens:,} prompt tokens would overrun the monthly token budget of {who}: "
                f"{spent}, {limit - used.tokens:,} left. It resets on {resets}.")
    limit = budget.cost_limit_picousd or 0
    spent = (f"${picousd_to_usd(used.cost_picousd):.6f} of ${picousd_to_usd(limit):.2f} used or held by running "
             f"requests in {month}")
    if used.cost_picousd >= limit:
        return f"The monthly cost budget of {who} is spent: {spent}. It resets on {resets}."
    return (f"This request's prompt (at least ${picousd_to_usd(floor.cost_picousd):.6f}) would overrun the monthly "
            f"cost budget of {who}: {spent}. It resets on {resets}.")


def set_budget(
    session: Session,
    *,
    tenant_id: str,
    api_key_id: str | None = None,
    monthly_token_limit: int | None = None,
    monthly_cost_limit_usd: Decimal | str | None = None,
) -> BudgetRow:
    """Create or replace a budget (the whole tenant's when `api_key_id` is None); None limits are unlimited."""
    scope = api_key_id or WHOLE_TENANT
    row = session.get(BudgetRow, (tenant_id, scope))
    if row is None:
        row = BudgetRow(tenant_id=tenant_id, api_key_id=scope)
        session.add(row)
    row.monthly_token_limit = monthly_token_limit
    row.monthly_cost_limit_picousd = (
        None if monthly_cost_limit_usd is None else usd_to_picousd(monthly_cost_limit_usd)
    )
    row.updated_at = datetime.now(UTC)
    session.flush()
    return row


def delete_budget(session: Session, *, tenant_id: str, api_key_id: str | None = None) -> bool:
    """Remove a budget (the whole tenant's when `api_key_id` is None); False if there was none."""
    row = session.get(BudgetRow, (tenant_id, api_key_id or WHOLE_TENANT))
    if row is None:
        return False
    session.delete(row)
    session.flush()
    return True


def validate_budget_limits(
    *, monthly_token_limit: object | None, monthly_cost_limit_usd: object | None
) -> tuple[int | None, Decimal | None]:
    """Limits given at the edge (API, CLI): a whole number of tokens >= 0, USD >= 0 to the micro-dollar."""
    tokens: int | None = None
    if monthly_token_limit is not None:
        if isinstance(monthly_token_limit, bool) or not isinstance(monthly_token_limit, int):
            raise InvalidRequestError("monthly_token_limit must be a whole number of tokens",
                                      param="monthly_token_limit")
        if monthly_token_limit > MAX_TOKEN_LIMIT:
            raise InvalidRequestError(f"monthly_token_limit must be at most {MAX_TOKEN_LIMIT}",
                                      param="monthly_token_limit")
        if monthly_token_limit < 0:
            raise InvalidRequestError("monthly_token_limit must not be negative", param="monthly_token_limit")
        tokens = monthly_token_limit
    cost = None if monthly_cost_limit_usd is None else parse_usd(monthly_cost_limit_usd, param="monthly_cost_limit_usd")
    return tokens, cost
