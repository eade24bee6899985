"""/v1/batches: OpenAI's Batch API. Create from an uploaded `batch` file, retrieve, list, cancel.

A batch is validated, run and finished by the API servers' batch workers
(platform/batches/worker.py); these routes only read and write its record.
Scope `inference`; another tenant's batch (or input file) is a 404.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from loraplex.engine.errors import InvalidRequestError
from loraplex.platform.api.json_types import JSONInt
from loraplex.platform.api.strict_json import StrictJSONRoute
from loraplex.platform.batches.objects import (
    COMPLETION_WINDOWS,
    ENDPOINTS,
    INPUT_PURPOSE,
    batch_public,
    list_page,
)
from loraplex.platform.deps import AppServices, InferenceKey
from loraplex.platform.routers.files import MAX_EXPIRES_AFTER_S, MIN_EXPIRES_AFTER_S, batches_domain
from pydantic import BaseModel, ConfigDict, Field

router = APIRouter(prefix="/v1", tags=["batches"], route_class=StrictJSONRoute)
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's


class OutputExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: JSONInt = Field(ge=MIN_EXPIRES_AFTER_S, le=MAX_EXPIRES_AFTER_S)


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(max_length=64)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: OutputExpiresAfter | None = None


def _check(body: BatchCreate) -> None:
    if body.endpoint not in ENDPOINTS:
        raise InvalidRequestError(f"endpoint {body.endpoint!r} is not supported; use one of {', '.join(ENDPOINTS)}",
                                  param="endpoint")
    if body.completion_window not in COMPLETION_WINDOWS:
        raise InvalidRequestError("completion_window must be '24h'", param="completion_window")
    metadata = body.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequestError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs", param="metadata")
    for name, value in metadata.items():
        if len(name) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidRequestError(f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters and values "
                                      f"at most {MAX_METADATA_VALUE_CHARS}", param=f"metadata.{name[:64]}")


@router.post("/batches")
async def create_batch(body: BatchCreate, key: InferenceKey, services: AppServices) -> dict[str, Any]:
    _check(body)
    domain = batches_domain(services)
    settings = services.settings
    input_file = await asyncio.to_thread(domain.files.get, key.tenant_id, body.input_file_id)
    if input_file.purpose != INPUT_PURPOSE:
        raise InvalidRequestError(f"file {input_file.id} has purpose {input_file.purpose!r}; a batch's input file "
                                  "must be uploaded with purpose 'batch'", param="input_file_id")
    row = await asyncio.to_thread(
        domain.repo.create, tenant_id=key.tenant_id, api_key_id=key.key_id, endpoint=body.endpoint,
        input_file_id=input_file.id, completion_window=body.completion_window, metadata=body.metadata,
        output_expires_after_s=body.output_expires_after.seconds if body.output_expires_after else None,
        window_s=settings.batch_completion_window_s, max_active=settings.batch_max_active_per_tenant or None)
    if domain.worker is not None:
        domain.worker.wake()
    return batch_public(row)


@router.get("/batches")
async def list_batches(key: InferenceKey, services: AppServices, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                       after: str | None = None) -> dict[str, Any]:
    rows, has_more = await asyncio.to_thread(batches_domain(services).repo.list, key.tenant_id, limit=limit,
                                             after=after)
    return list_page([batch_public(row) for row in rows], has_more=has_more)


@router.get("/batches/{batch_id}")
async def retrieve_batch(batch_id: str, key: InferenceKey, services: AppServices) -> dict[str, Any]:
    return batch_public(await asyncio.to_thread(batches_domain(services).repo.get, key.tenant_id, batch_id))


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, key: InferenceKey, services: AppServices) -> dict[str, Any]:
    domain = batches_domain(services)
    row = await asyncio.to_thread(domain.repo.cancel, key.tenant_id, batch_id)
    if domain.worker is not None:
        domain.worker.cancelled(batch_id)
    return batch_public(row)
