"""The Batch API's tables: files, batches and one row per request line of a batch.

Own DeclarativeBase (no foreign keys into other domains' tables). Times the
API shows are Unix seconds, as OpenAI's objects carry them; every query in
repository.py and files.py filters by tenant.
"""

from __future__ import annotations

from typing import ClassVar

from sqlalchemy import BigInteger, Boolean, Float, Index, Integer, MetaData, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "pk": "pk_%(table_name)s",
}


class BatchesBase(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar = {int: BigInteger()}


class FileRow(BatchesBase):
    """A tenant's file: its bytes are a blob named by their sha256 in the file store."""

    __tablename__ = "batch_files"
    __table_args__ = (Index("ix_batch_files_tenant_created", "tenant_id", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)          # "file-<hex>"
    tenant_id: Mapped[str] = mapped_column(String(64))
    purpose: Mapped[str] = mapped_column(String(32))                        # batch | batch_output
    filename: Mapped[str] = mapped_column(String(256))
    bytes: Mapped[int]
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[int]
    expires_at: Mapped[int | None]


class BatchRow(BatchesBase):
    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_batches_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)          # "batch_<hex>"
    tenant_id: Mapped[str] = mapped_column(String(64))
    api_key_id: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    model: Mapped[str | None] = mapped_column(String(200))
    metadata_json: Mapped[str | None] = mapped_column(Text)
    errors_json: Mapped[str | None] = mapped_column(Text)                  # validation errors (status failed)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    output_expires_after_s: Mapped[int | None]
    created_at: Mapped[int]
    expires_at: Mapped[int]
    in_progress_at: Mapped[int | None]
    finalizing_at: Mapped[int | None]
    completed_at: Mapped[int | None]
    failed_at: Mapped[int | None]
    expired_at: Mapped[int | None]
    cancelling_at: Mapped[int | None]
    cancelled_at: Mapped[int | None]
    num_total: Mapped[int] = mapped_column(default=0)
    num_completed: Mapped[int] = mapped_column(default=0)
    num_failed: Mapped[int] = mapped_column(default=0)
    input_tokens: Mapped[int] = mapped_column(default=0)
    cached_input_tokens: Mapped[int] = mapped_column(default=0)
    output_tokens: Mapped[int] = mapped_column(default=0)
    reasoning_tokens: Mapped[int] = mapped_column(default=0)
    # The worker running it; another takes it over once `lease_expires_at` (epoch seconds) has passed.
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_expires_at: Mapped[float | None] = mapped_column(Float)


class BatchLineRow(BatchesBase):
    """One request of a batch: where it is in the input file, and once done its output line and usage.

    `metered` turns true once the line's usage event is durable in the meter's journal; a worker that
    resumes a batch records again the usage of finished lines without it (the ledger keeps the first).
    """

    __tablename__ = "batch_lines"

    batch_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    line_index: Mapped[int] = mapped_column(Integer, primary_key=True)    # 0-based; errors show it 1-based
    custom_id: Mapped[str] = mapped_column(Text)
    model: Mapped[str] = mapped_column(String(200))
    offset: Mapped[int]                                                     # the line's bytes in the input file
    length: Mapped[int]
    status: Mapped[str] = mapped_column(String(16), default="pending")      # pending | completed | failed
    result: Mapped[str | None] = mapped_column(Text)                        # the output (or error) file's line
    adapter_id: Mapped[str | None] = mapped_column(String(200))
    usage_status: Mapped[str | None] = mapped_column(String(16))           # the usage event's status
    started_at: Mapped[float | None] = mapped_column(Float)
    input_tokens: Mapped[int] = mapped_column(default=0)
    cached_input_tokens: Mapped[int] = mapped_column(default=0)
    output_tokens: Mapped[int] = mapped_column(default=0)
    reasoning_tokens: Mapped[int] = mapped_column(default=0)
    metered: Mapped[bool] = mapped_column(Boolean, default=False)
