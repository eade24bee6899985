"""Monthly budgets per tenant and per API key, checked before a request is queued.

Spending lives in counters keyed by UTC month (Redis hashes when Redis is
configured, a dict otherwise), so a new month starts from zero by itself. The
meter adds each event once, when the ledger first stores it; `reconcile`
resets the counters from the ledger (the beat task runs it), which repairs
anything a Redis restart or a crash lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any, Protocol

from loraplex.billing.events import UsageEvent
from loraplex.billing.ledger import UNAVAILABLE_ERRORS
from loraplex.billing.models import NONE_KEY, BudgetRow, UsageEventRow
from loraplex.billing.pricing import parse_usd, picousd_to_usd, usd_to_picousd
from loraplex.engine.errors import EngineError, InvalidRequestError
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

WHOLE_TENANT = NONE_KEY
_COUNTER_TTL_S = 70 * 86400  # a month's counters outlive the month, then expire


class QuotaExceededError(EngineError):
    status = 429
    code = "insufficient_quota"


@dataclass(frozen=True, slots=True)
class Budget:
    token_limit: int | None = None
    cost_limit_picousd: int | None = None


@dataclass(frozen=True, slots=True)
class Spend:
    tokens: int = 0
    cost_picousd: int = 0


def month_of(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m")


def month_bounds(month: str) -> tuple[date, date]:
    """First day of the month and first day of the next."""
    first = date.fromisoformat(f"{month}-01")
    following = date(first.year + first.month // 12, first.month % 12 + 1, 1)
    return first, following


class SpendCounter(Protocol):
    def add(self, month: str, tenant_id: str, scope: str, spend: Spend) -> None: ...
    def get(self, month: str, tenant_id: str, scope: str) -> Spend: ...
    def set(self, month: str, tenant_id: str, scope: str, spend: Spend) -> None: ...


class MemorySpendCounter:
    def __init__(self) -> None:
        self._spend: dict[tuple[str, str, str], Spend] = {}
        self._lock = threading.Lock()

    def add(self, month: str, tenant_id: str, scope: str, spend: Spend) -> None:
        with self._lock:
            old = self._spend.get((month, tenant_id, scope), Spend())
            self._spend[month, tenant_id, scope] = Spend(old.tokens + spend.tokens, old.cost_picousd + spend.cost_picousd)

    def get(self, month: str, tenant_id: str, scope: str) -> Spend:
        return self._spend.get((month, tenant_id, scope), Spend())

    def set(self, month: str, tenant_id: str, scope: str, spend: Spend) -> None:
        with self._lock:
            self._spend[month, tenant_id, scope] = spend


class RedisSpendCounter:
    def __init__(self, client: Any, key_prefix: str) -> None:
        self._redis = client
        self._prefix = key_prefix

    def _key(self, month: str, tenant_id: str, scope: str) -> str:
        return f"{self._prefix}billing:spend:{month}:{tenant_id}:{scope or '*'}"

    def add(self, month: str, tenant_id: str, scope: str, spend: Spend) -> None:
        key = self._key(month, tenant_id, scope)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hincrby(key, "tokens", spend.tokens)
        pipe.hincrby(key, "cost", spend.cost_picousd)
        pipe.expire(key, _COUNTER_TTL_S)
        pipe.execute()

    def get(self, month: str, tenant_id: str, scope: str) -> Spend:
        tokens, cost = self._redis.hmget(self._key(month, tenant_id, scope), "tokens", "cost")
        return Spend(int(tokens or 0), int(cost or 0))

    def set(self, month: str, tenant_id: str, scope: str, spend: Spend) -> None:
        key = self._key(month, tenant_id, scope)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(key, mapping={"tokens": spend.tokens, "cost": spend.cost_picousd})
        pipe.expire(key, _COUNTER_TTL_S)
        pipe.execute()


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
        self, session_factory: sessionmaker[Session], counter: SpendCounter, *, budget_cache_s: float = 5.0
    ) -> None:
        self._session_factory = session_factory
        self._counter = counter
        self._cache_s = budget_cache_s
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

    def on_recorded(self, events: list[UsageEvent], costs: dict[str, int]) -> None:
        """Meter callback: count events the ledger stored for the first time."""
        totals: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
        for event in events:
            month = month_of(event.created_at)
            cost = costs.get(event.request_id, 0)
            for scope in {WHOLE_TENANT, event.api_key_id or WHOLE_TENANT}:
                total = totals[month, event.tenant_id, scope]
                total[0] += event.total_tokens
                total[1] += cost
        for (month, tenant_id, scope), (tokens, cost) in totals.items():
            self._counter.add(month, tenant_id, scope, Spend(tokens, cost))

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
        if monthly_token_limit < 0:
            raise InvalidRequestError("monthly_token_limit must not be negative", param="monthly_token_limit")
        tokens = monthly_token_limit
    cost = None if monthly_cost_limit_usd is None else parse_usd(monthly_cost_limit_usd, param="monthly_cost_limit_usd")
    return tokens, cost
