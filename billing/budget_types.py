"""The values budgets are made of: limits, spend, holds on a budget, and the one admission rule.

Shared by the counters (billing/spend_counters.py) and the guard (billing/quotas.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Protocol

from loraplex.billing.models import NONE_KEY

WHOLE_TENANT = NONE_KEY


def month_of(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m")


def month_bounds(month: str) -> tuple[date, date]:
    """First day of the month and first day of the next."""
    first = date.fromisoformat(f"{month}-01")
    following = date(first.year + first.month // 12, first.month % 12 + 1, 1)
    return first, following


@dataclass(frozen=True, slots=True)
class Budget:
    token_limit: int | None = None
    cost_limit_picousd: int | None = None


@dataclass(frozen=True, slots=True)
class Spend:
    tokens: int = 0
    cost_picousd: int = 0


@dataclass(frozen=True, slots=True)
class ScopeHold:
    """One budget a reservation is checked against and held on (WHOLE_TENANT or an API key id)."""

    scope: str
    budget: Budget


@dataclass(frozen=True, slots=True)
class Refusal:
    scope: str
    used: Spend     # recorded spend plus outstanding reservations
    by_cost: bool   # False: the token limit refused it


@dataclass(frozen=True, slots=True)
class Settlement:
    """A request's recorded usage: it replaces the request's reservation on each of `scopes`."""

    month: str
    tenant_id: str
    scopes: tuple[str, ...]
    request_id: str
    actual: Spend


def refuses(budget: Budget, used: Spend, floor: Spend) -> Refusal | None:
    """The admission rule, the same in every counter: refuse once the budget is used up (reservations
    included), or when the prompt alone (`floor`) would overrun what is left."""
    limit = budget.token_limit
    if limit is not None and (used.tokens >= limit or used.tokens + floor.tokens > limit):
        return Refusal("", used, by_cost=False)
    limit = budget.cost_limit_picousd
    if limit is not None and (used.cost_picousd >= limit or used.cost_picousd + floor.cost_picousd > limit):
        return Refusal("", used, by_cost=True)
    return None


class SpendCounter(Protocol):
    def add(self, month: str, tenant_id: str, scope: str, spend: Spend) -> None: ...
    def get(self, month: str, tenant_id: str, scope: str) -> Spend: ...
    def set(self, month: str, tenant_id: str, scope: str, spend: Spend) -> None: ...

    def reserve(self, *, month: str, tenant_id: str, request_id: str, holds: list[ScopeHold], amount: Spend,
                floor: Spend, expires_at: float, now: float) -> Refusal | None:
        """Atomically: check every hold (`refuses`), then hold `amount` on each; None when reserved."""

    def settle(self, settlements: list[Settlement]) -> None:
        """Atomically per settlement: drop its reservations and add its actual usage to the month's spend."""
