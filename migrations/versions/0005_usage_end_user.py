"""Billing: the end user of each usage event (OpenAI's `user` field), for usage by user.

Revision ID: 0005_usage_end_user
Revises: 0004_request_log_indexes
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_usage_end_user"
down_revision = "0004_request_log_indexes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable and without a default: adding it rewrites no rows, on PostgreSQL or SQLite.
    op.add_column("billing_usage_events", sa.Column("end_user", sa.String(256), nullable=True))
    op.create_index("ix_billing_usage_events_tenant_user", "billing_usage_events",
                    ["tenant_id", "end_user", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_billing_usage_events_tenant_user", table_name="billing_usage_events")
    with op.batch_alter_table("billing_usage_events") as batch:
        batch.drop_column("end_user")
