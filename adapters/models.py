"""The adapters domain's table: one row per tenant adapter, pointing at its blobs by digest.

Own DeclarativeBase (no foreign keys into the platform's tables): `tenant_id`
is an indexed string, and every query in `registry.py` filters by it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import ClassVar

from sqlalchemy import BigInteger, DateTime, Float, Integer, MetaData, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "pk": "pk_%(table_name)s",
}


class AdaptersBase(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar = {datetime: DateTime(timezone=True)}


class AdapterStatus(StrEnum):
    VALIDATING = "validating"
    READY = "ready"
    FAILED = "failed"


def utcnow() -> datetime:
    return datetime.now(UTC)


class AdapterRecord(AdaptersBase):
    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_adapters_tenant_id_name"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # "adp_<hex>"
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(128))
    description: Mapped[str] = mapped_column(Text, default="")
    status: Mapped[str] = mapped_column(String(16), default=AdapterStatus.VALIDATING)
    reason: Mapped[str | None] = mapped_column(Text, default=None)
    rank: Mapped[int | None] = mapped_column(Integer, default=None)
    alpha: Mapped[float | None] = mapped_column(Float, default=None)
    target_modules: Mapped[str] = mapped_column(String(200), default="")  # space-separated
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64), index=True)         # adapter_model.safetensors blob
    config_sha256: Mapped[str] = mapped_column(String(64))              # adapter_config.json blob
    base_model: Mapped[str | None] = mapped_column(String(500), default=None)  # as the config named it
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    ready_at: Mapped[datetime | None] = mapped_column(default=None)
