"""Bodies of the billing admin routes (prices and budgets).

Money fields accept a JSON string ("0.15", exact) or a number; both are checked
by billing's own validators (`validate_new_price`, `validate_budget_limits`),
shared with the CLI, so the schemas only shape the body.
"""

from __future__ import annotations

from datetime import datetime

from loraplex.billing.pricing import Price, micro_to_usd, usd_text
from loraplex.platform.api.json_types import JSONInt
from pydantic import BaseModel, ConfigDict, Field, StrictInt

Usd = str | StrictInt | float


class PriceCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=200, description="a served model name, or * for any")
    adapter_id: str | None = Field(default=None, max_length=200, description="an adapter id; omit for any")
    input: Usd = Field(description="USD per million uncached input tokens")
    output: Usd = Field(description="USD per million output tokens")
    cached_input: Usd | None = Field(default=None, description="default: the input price")
    thinking: Usd | None = Field(default=None, description="default: the output price")
    effective_from: datetime | None = Field(default=None, description="default: now; never in the past")


class PricePublic(BaseModel):
    id: int
    object: str = "price"
    model: str
    adapter_id: str | None
    input: str                 # USD per million tokens, exact decimal strings
    cached_input: str
    output: str
    thinking: str
    effective_from: datetime
    in_force: bool             # the price its (model, adapter) pair pays now

    @classmethod
    def of(cls, price: Price, *, in_force: bool) -> PricePublic:
        return cls(
            id=price.id, model=price.model, adapter_id=price.adapter_id, input=_usd(price.input),
            cached_input=_usd(price.cached_input), output=_usd(price.output), thinking=_usd(price.thinking),
            effective_from=price.effective_from, in_force=in_force,
        )


class BudgetUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    api_key_id: str | None = Field(default=None, max_length=64, description="one key's budget; omit for the tenant's")
    monthly_token_limit: JSONInt | None = Field(default=None, ge=0, le=2**63 - 1)  # a 64-bit column
    monthly_cost_limit_usd: Usd | None = None


def _usd(micro: int) -> str:
    return usd_text(micro_to_usd(micro))
