"""Tenants: a weight in the engine's fair sharing.

Revision ID: 0008_tenant_weight
Revises: 0007_batches
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_tenant_weight"
down_revision = "0007_batches"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("weight", sa.Float(), nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("weight")
