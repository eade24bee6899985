"""Billing: indexes for the per-request usage log (tenant's events newest first; a tenant's session).

Revision ID: 0004_request_log_indexes
Revises: 0003_billing
"""

from __future__ import annotations

from alembic import op

revision = "0004_request_log_indexes"
down_revision = "0003_billing"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_billing_usage_events_tenant_created", "billing_usage_events",
                    ["tenant_id", "created_at", "id"])
    op.create_index("ix_billing_usage_events_tenant_session", "billing_usage_events", ["tenant_id", "session_id"])


def downgrade() -> None:
    op.drop_index("ix_billing_usage_events_tenant_session", table_name="billing_usage_events")
    op.drop_index("ix_billing_usage_events_tenant_created", table_name="billing_usage_events")
