"""/v1/files: OpenAI's Files API for the Batch API's input and output files.

Upload (multipart `purpose` + `file`, streamed to disk; `purpose` must be
`batch`), list (newest first, `after` cursor, `purpose` filter), retrieve,
download the content, delete. Scope `inference`; another tenant's file id is
a 404. Output and error files of batches appear here with purpose
`batch_output`. Sizes and counts: the `batch_file_*` settings.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from loraplex.adapters.upload import run_upload_work
from loraplex.engine.errors import InvalidRequestError
from loraplex.platform.api.strict_json import StrictJSONRoute
from loraplex.platform.batches.objects import INPUT_PURPOSE, file_public, list_page
from loraplex.platform.batches.upload import receive_file
from loraplex.platform.batches.worker import BatchesDomain
from loraplex.platform.body_limit import declared_length
from loraplex.platform.deps import AppServices, InferenceKey
from loraplex.platform.errors import ApiError
from loraplex.platform.services import Services
from starlette.requests import ClientDisconnect

router = APIRouter(prefix="/v1", tags=["files"], route_class=StrictJSONRoute)
MIN_EXPIRES_AFTER_S, MAX_EXPIRES_AFTER_S = 3600, 30 * 86400   # OpenAI's bounds for expires_after.seconds


def batches_domain(services: Services) -> BatchesDomain:
    return services.extensions.domain_state["batches"]


@router.post("/files")
async def create_file(request: Request, key: InferenceKey, services: AppServices) -> Response:
    files = batches_domain(services).files
    settings = services.settings
    await asyncio.to_thread(files.check_quota, key.tenant_id, num_new_bytes=0)  # before a byte is received
    fd, name = tempfile.mkstemp(dir=files.uploads, prefix="file-")
    os.close(fd)
    path = Path(name)
    length = request.headers.get("content-length")
    try:
        received = await receive_file(request.stream(), request.headers.get("content-type", ""), path,
                                      max_file_bytes=settings.batch_max_file_bytes,
                                      content_length=declared_length(length))
        purpose = received.fields.get("purpose")
        if not purpose:
            raise InvalidRequestError("the form field 'purpose' is required", param="purpose")
        if purpose != INPUT_PURPOSE:
            raise InvalidRequestError(f"purpose {purpose!r} is not supported here; files are for the Batch API: "
                                      "purpose 'batch'", param="purpose")
        if received.num_bytes == 0:  # no batch can be made of it: say so now, not when a batch of it fails
            raise ApiError("the file is empty; a batch input file holds one request per line", param="file",
                           code="empty_file")
        expires_at = int(time.time()) + _expires_after(received.fields, settings.batch_file_expires_after_s)
        row = await run_upload_work(files.add, tenant_id=key.tenant_id, purpose=purpose,
                                    filename=received.filename or "upload.jsonl", path=path, expires_at=expires_at)
    except ClientDisconnect:
        return Response(status_code=499)
    finally:
        path.unlink(missing_ok=True)
    return JSONResponse(file_public(row))


def _expires_after(fields: dict[str, str], default_s: int) -> int:
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return default_s
    if anchor != "created_at":
        raise InvalidRequestError("expires_after.anchor must be 'created_at'", param="expires_after.anchor")
    whole = seconds is not None and seconds.isascii() and seconds.isdigit() and len(seconds) <= 12
    if seconds is None or not whole or not MIN_EXPIRES_AFTER_S <= int(seconds) <= MAX_EXPIRES_AFTER_S:
        raise InvalidRequestError(f"expires_after.seconds must be a whole number from {MIN_EXPIRES_AFTER_S} to "
                                  f"{MAX_EXPIRES_AFTER_S}", param="expires_after.seconds")
    return int(seconds)


@router.get("/files")
async def list_files(
    key: InferenceKey, services: AppServices, purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000, order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    rows, has_more = await asyncio.to_thread(batches_domain(services).files.list, key.tenant_id, purpose=purpose,
                                             limit=limit, order=order, after=after)
    return list_page([file_public(row) for row in rows], has_more=has_more)


@router.get("/files/{file_id}")
async def retrieve_file(file_id: str, key: InferenceKey, services: AppServices) -> dict[str, Any]:
    row = await asyncio.to_thread(batches_domain(services).files.get, key.tenant_id, file_id)
    return file_public(row)


@router.get("/files/{file_id}/content")
async def file_content(file_id: str, key: InferenceKey, services: AppServices) -> FileResponse:
    files = batches_domain(services).files
    row = await asyncio.to_thread(files.get, key.tenant_id, file_id)
    return FileResponse(files.path(row), media_type="application/octet-stream", filename=row.filename)


@router.delete("/files/{file_id}")
async def delete_file(file_id: str, key: InferenceKey, services: AppServices) -> dict[str, Any]:
    await asyncio.to_thread(batches_domain(services).files.delete, key.tenant_id, file_id)
    return {"id": file_id, "object": "file", "deleted": True}
