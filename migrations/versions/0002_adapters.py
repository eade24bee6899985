"""Adapters: one row per tenant adapter, pointing at content-addressed blobs.

Revision ID: 0002_adapters
Revises: 0001_platform
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_adapters"
down_revision = "0001_platform"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("alpha", sa.Float(), nullable=True),
        sa.Column("target_modules", sa.String(200), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("config_sha256", sa.String(64), nullable=False),
        sa.Column("base_model", sa.String(500), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ready_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_adapters"),
        sa.UniqueConstraint("tenant_id", "name", name="uq_adapters_tenant_id_name"),
    )
    op.create_index("ix_adapters_tenant_id", "adapters", ["tenant_id"])
    op.create_index("ix_adapters_sha256", "adapters", ["sha256"])


def downgrade() -> None:
    op.drop_index("ix_adapters_sha256", table_name="adapters")
    op.drop_index("ix_adapters_tenant_id", table_name="adapters")
    op.drop_table("adapters")
