"""Batch API: files, batches and their request lines.

Revision ID: 0007_batches
Revises: 0006_budget_reservations
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_batches"
down_revision = "0006_budget_reservations"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "batch_files",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(256), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_batch_files"),
    )
    op.create_index("ix_batch_files_tenant_created", "batch_files", ["tenant_id", "created_at", "id"])
    op.create_index("ix_batch_files_sha256", "batch_files", ["sha256"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("api_key_id", sa.String(64), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("model", sa.String(200), nullable=True),
        sa.Column("metadata_json", sa.Text(), nullable=True),
        sa.Column("errors_json", sa.Text(), nullable=True),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        sa.Column("output_expires_after_s", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.BigInteger(), nullable=False),
        *[sa.Column(name, sa.BigInteger(), nullable=True) for name in (
            "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
            "cancelled_at")],
        *[sa.Column(name, sa.BigInteger(), nullable=False) for name in (
            "num_total", "num_completed", "num_failed", "input_tokens", "cached_input_tokens", "output_tokens",
            "reasoning_tokens")],
        sa.Column("lease_owner", sa.String(128), nullable=True),
        sa.Column("lease_expires_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_batches"),
    )
    op.create_index("ix_batches_tenant_created", "batches", ["tenant_id", "created_at", "id"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(64), nullable=False),
        sa.Column("line_index", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.Text(), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("length", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("result", sa.Text(), nullable=True),
        sa.Column("adapter_id", sa.String(200), nullable=True),
        sa.Column("usage_status", sa.String(16), nullable=True),
        sa.Column("started_at", sa.Float(), nullable=True),
        *[sa.Column(name, sa.BigInteger(), nullable=False) for name in (
            "input_tokens", "cached_input_tokens", "output_tokens", "reasoning_tokens")],
        sa.Column("metered", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("batch_id", "line_index", name="pk_batch_lines"),
    )


def downgrade() -> None:
    op.drop_table("batch_lines")
    op.drop_index("ix_batches_status", table_name="batches")
    op.drop_index("ix_batches_tenant_created", table_name="batches")
    op.drop_table("batches")
    op.drop_index("ix_batch_files_sha256", table_name="batch_files")
    op.drop_index("ix_batch_files_tenant_created", table_name="batch_files")
    op.drop_table("batch_files")
