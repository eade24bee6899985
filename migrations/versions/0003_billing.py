"""Billing: usage events (the ledger), price book, daily rollups, rolled-up days, budgets.

Revision ID: 0003_billing
Revises: 0002_adapters
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_billing"
down_revision = "0002_adapters"
branch_labels = None
depends_on = None

# SQLite only auto-increments an INTEGER PRIMARY KEY.
_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "billing_usage_events",
        sa.Column("id", _BIG_ID, autoincrement=True, nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("api_key_id", sa.String(64), nullable=True),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("adapter_id", sa.String(200), nullable=True),
        sa.Column("session_id", sa.String(64), nullable=True),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_input_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("thinking_tokens", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("duration_ms", sa.Float(), nullable=False),
        sa.Column("cost_picousd", sa.BigInteger(), nullable=False),
        sa.Column("price_id", sa.BigInteger(), nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("recorded_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_billing_usage_events"),
        sa.UniqueConstraint("request_id", name="uq_billing_usage_events_request_id"),
    )
    op.create_index("ix_billing_usage_events_tenant_day", "billing_usage_events", ["tenant_id", "day"])
    op.create_index("ix_billing_usage_events_day_recorded", "billing_usage_events", ["day", "recorded_at"])

    op.create_table(
        "billing_prices",
        sa.Column("id", _BIG_ID, autoincrement=True, nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("adapter_id", sa.String(200), nullable=True),
        sa.Column("input_micro_usd_per_mtok", sa.BigInteger(), nullable=False),
        sa.Column("cached_input_micro_usd_per_mtok", sa.BigInteger(), nullable=False),
        sa.Column("output_micro_usd_per_mtok", sa.BigInteger(), nullable=False),
        sa.Column("thinking_micro_usd_per_mtok", sa.BigInteger(), nullable=False),
        sa.Column("effective_from", _TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_billing_prices"),
    )
    op.create_index("ix_billing_prices_model", "billing_prices", ["model"])

    op.create_table(
        "billing_usage_daily",
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("adapter_id", sa.String(200), nullable=False),
        sa.Column("api_key_id", sa.String(64), nullable=False),
        sa.Column("input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("thinking_tokens", sa.BigInteger(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("cost_picousd", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("day", "tenant_id", "model", "adapter_id", "api_key_id",
                                name="pk_billing_usage_daily"),
    )

    op.create_table(
        "billing_rolled_up_days",
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("computed_at", _TS, nullable=False),
        sa.Column("num_events", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("day", name="pk_billing_rolled_up_days"),
    )

    op.create_table(
        "billing_budgets",
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("api_key_id", sa.String(64), nullable=False),
        sa.Column("monthly_token_limit", sa.BigInteger(), nullable=True),
        sa.Column("monthly_cost_limit_picousd", sa.BigInteger(), nullable=True),
        sa.Column("updated_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "api_key_id", name="pk_billing_budgets"),
    )


def downgrade() -> None:
    op.drop_table("billing_budgets")
    op.drop_table("billing_rolled_up_days")
    op.drop_table("billing_usage_daily")
    op.drop_index("ix_billing_prices_model", table_name="billing_prices")
    op.drop_table("billing_prices")
    op.drop_index("ix_billing_usage_events_day_recorded", table_name="billing_usage_events")
    op.drop_index("ix_billing_usage_events_tenant_day", table_name="billing_usage_events")
    op.drop_table("billing_usage_events")
