"""Billing tables: usage events (the ledger), the price book, daily rollups and budgets.

Billing keeps its own declarative base: no foreign keys into the platform's
tables, so tenants and keys are plain string ids here. Money is stored as
integers: prices in micro-USD per million tokens, costs in pico-USD
(1e-12 USD), which is exactly tokens × price, so sums never drift.
"""

from __future__ import annotations

from datetime import date, datetime
from typing import Any, ClassVar

from sqlalchemy import BigInteger, Date, DateTime, Float, Index, Integer, MetaData, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Deterministic constraint names for Alembic (same convention as the platform's base).
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments an INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")

# Rollups and budgets use "" for "none" (base model, no key, whole tenant) so they can be key columns.
NONE_KEY = ""


class BillingBase(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: DateTime(timezone=True), int: Integer(), date: Date(), float: Float(),
    }


class UsageEventRow(BillingBase):
    __tablename__ = "billing_usage_events"
    __table_args__ = (
        UniqueConstraint("request_id", name="uq_billing_usage_events_request_id"),
        Index("ix_billing_usage_events_tenant_day", "tenant_id", "day"),
        Index("ix_billing_usage_events_day_recorded", "day", "recorded_at"),
        # The per-request log: a tenant's events newest first (keyset on created_at, id), and by session.
        Index("ix_billing_usage_events_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_billing_usage_events_tenant_session", "tenant_id", "session_id"),
        # Usage by end user: the request log's `user` filter and reports grouped by user.
        Index("ix_billing_usage_events_tenant_user", "tenant_id", "end_user", "created_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(128))
    tenant_id: Mapped[str] = mapped_column(String(64))
    api_key_id: Mapped[str | None] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(200))
    adapter_id: Mapped[str | None] = mapped_column(String(200))
    session_id: Mapped[str | None] = mapped_column(String(64))
    # OpenAI's `user` ("user" is reserved in SQL); reports and the API call it `user`.
    end_user: Mapped[str | None] = mapped_column(String(256))
    input_tokens: Mapped[int]
    cached_input_tokens: Mapped[int]
    output_tokens: Mapped[int]
    thinking_tokens: Mapped[int]
    status: Mapped[str] = mapped_column(String(16))
    ttft_ms: Mapped[float | None]
    duration_ms: Mapped[float]
    cost_picousd: Mapped[int] = mapped_column(BigInteger)
    price_id: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime]          # when the request arrived
    day: Mapped[date]                     # UTC day of created_at: the rollup bucket
    recorded_at: Mapped[datetime]         # when the ledger stored it (late events mark their day stale)


class PriceRow(BillingBase):
    """Prices per million tokens, in micro-USD; the row in force is the latest effective_from <= event time.

    `model` "*" matches any model and a NULL `adapter_id` any adapter; the most
    specific match wins.
    """

    __tablename__ = "billing_prices"
    __table_args__ = (Index("ix_billing_prices_model", "model"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(200))
    adapter_id: Mapped[str | None] = mapped_column(String(200))
    input_micro_usd_per_mtok: Mapped[int] = mapped_column(BigInteger)
    cached_input_micro_usd_per_mtok: Mapped[int] = mapped_column(BigInteger)
    output_micro_usd_per_mtok: Mapped[int] = mapped_column(BigInteger)
    thinking_micro_usd_per_mtok: Mapped[int] = mapped_column(BigInteger)
    effective_from: Mapped[datetime]


class DailyUsageRow(BillingBase):
    __tablename__ = "billing_usage_daily"

    day: Mapped[date] = mapped_column(primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    adapter_id: Mapped[str] = mapped_column(String(200), primary_key=True)   # NONE_KEY: base model
    api_key_id: Mapped[str] = mapped_column(String(64), primary_key=True)    # NONE_KEY: no key
    input_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_input_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    thinking_tokens: Mapped[int] = mapped_column(BigInteger)
    requests: Mapped[int] = mapped_column(BigInteger)
    cost_picousd: Mapped[int] = mapped_column(BigInteger)


class RolledUpDayRow(BillingBase):
    """A day whose rollup is current; reports read rollups only for days listed here."""

    __tablename__ = "billing_rolled_up_days"

    day: Mapped[date] = mapped_column(primary_key=True)
    computed_at: Mapped[datetime]
    num_events: Mapped[int] = mapped_column(BigInteger)


class BudgetRow(BillingBase):
    """A monthly budget for a whole tenant (api_key_id NONE_KEY) or one of its keys; NULL = unlimited."""

    __tablename__ = "billing_budgets"

    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    monthly_token_limit: Mapped[int | None] = mapped_column(BigInteger)
    monthly_cost_limit_picousd: Mapped[int | None] = mapped_column(BigInteger)
    updated_at: Mapped[datetime]


class BudgetSpendRow(BillingBase):
    """A month's recorded spend per (tenant, scope) when no Redis is configured; reconciled from the ledger."""

    __tablename__ = "billing_budget_spend"

    month: Mapped[str] = mapped_column(String(7), primary_key=True)   # "2026-11"
    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    scope: Mapped[str] = mapped_column(String(64), primary_key=True)  # NONE_KEY: the whole tenant; else a key id
    tokens: Mapped[int] = mapped_column(BigInteger)
    cost_picousd: Mapped[int] = mapped_column(BigInteger)


class BudgetReservationRow(BillingBase):
    """A running request's maximum cost, held against a budget until its usage is recorded (or it expires)."""

    __tablename__ = "billing_budget_reservations"
    __table_args__ = (Index("ix_billing_budget_reservations_tenant_scope", "tenant_id", "scope"),)

    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    scope: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    tokens: Mapped[int] = mapped_column(BigInteger)
    cost_picousd: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[float]  # epoch seconds: a crashed request's hold lapses by itself
