"""Billing: budget spend counters and reservations held in the database when no Redis is configured.

Revision ID: 0006_budget_reservations
Revises: 0005_usage_end_user
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_budget_reservations"
down_revision = "0005_usage_end_user"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "billing_budget_spend",
        sa.Column("month", sa.String(7), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("scope", sa.String(64), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost_picousd", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("month", "tenant_id", "scope", name="pk_billing_budget_spend"),
    )
    op.create_table(
        "billing_budget_reservations",
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("scope", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost_picousd", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("request_id", "scope", name="pk_billing_budget_reservations"),
    )
    op.create_index("ix_billing_budget_reservations_tenant_scope", "billing_budget_reservations",
                    ["tenant_id", "scope"])


def downgrade() -> None:
    op.drop_index("ix_billing_budget_reservations_tenant_scope", table_name="billing_budget_reservations")
    op.drop_table("billing_budget_reservations")
    op.drop_table("billing_budget_spend")
