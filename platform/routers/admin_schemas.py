"""Bodies of the admin routes (tenants and API keys)."""

from __future__ import annotations

from datetime import datetime

from loraplex.platform.api.json_types import JSONFloat, JSONInt
from loraplex.platform.auth.scopes import Scope, parse_scopes
from loraplex.platform.auth.store import MAX_TENANT_WEIGHT, MIN_TENANT_WEIGHT
from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_RATE_LIMIT = 2**31 - 1  # the columns are 32-bit integers


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    weight: JSONFloat = Field(default=1.0, ge=MIN_TENANT_WEIGHT, le=MAX_TENANT_WEIGHT, allow_inf_nan=False)


class TenantUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight: JSONFloat = Field(ge=MIN_TENANT_WEIGHT, le=MAX_TENANT_WEIGHT, allow_inf_nan=False)


class TenantPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    created_at: datetime
    weight: float


class ApiKeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field we do not have (`expires_at`) is a 400, never ignored

    name: str = Field(default="", max_length=200)
    scopes: list[Scope] = Field(default_factory=lambda: [Scope.INFERENCE])
    rpm_limit: JSONInt | None = Field(default=None, ge=0, le=MAX_RATE_LIMIT)
    tpm_limit: JSONInt | None = Field(default=None, ge=0, le=MAX_RATE_LIMIT)

    @field_validator("scopes", mode="before")
    @classmethod
    def _known_scopes(cls, value: object) -> object:
        if isinstance(value, list | str):
            return parse_scopes(value)
        return value


class ApiKeyPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    tenant_id: str
    name: str
    key_prefix: str
    scopes: list[str]
    rpm_limit: int | None
    tpm_limit: int | None
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None

    @field_validator("scopes", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        return value.split() if isinstance(value, str) else value


class ApiKeyCreated(ApiKeyPublic):
    key: str  # the only time the full key is ever returned
