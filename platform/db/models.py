"""Tenants and their API keys."""

from __future__ import annotations

from datetime import datetime

from loraplex.platform.db.base import PlatformBase, utcnow
from sqlalchemy import Float, ForeignKey, Index, String
from sqlalchemy.orm import Mapped, mapped_column, relationship


class Tenant(PlatformBase):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # "ten_<hex>"
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Its weight in the engine's fair sharing of slots, KV blocks and step tokens (2.0: twice an ordinary share)
    weight: Mapped[float] = mapped_column(Float(), default=1.0, server_default="1")

    api_keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant")


class ApiKey(PlatformBase):
    __tablename__ = "api_keys"
    __table_args__ = (Index("ix_api_keys_tenant_id", "tenant_id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # "key_<hex>"
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200), default="")
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the full key
    key_prefix: Mapped[str] = mapped_column(String(16))              # first characters, shown in listings
    scopes: Mapped[str] = mapped_column(String(200))                 # space-separated Scope values
    rpm_limit: Mapped[int | None] = mapped_column(default=None)      # None: the settings default
    tpm_limit: Mapped[int | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(default=None)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)

    tenant: Mapped[Tenant] = relationship(back_populates="api_keys")

    @property
    def scope_set(self) -> frozenset[str]:
        return frozenset(self.scopes.split())

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None
