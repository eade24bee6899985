"""Liveness and Prometheus metrics (no auth: scraped by infrastructure)."""

from __future__ import annotations

import os

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from loraplex.platform.deps import AppServices
from prometheus_client import CONTENT_TYPE_LATEST

router = APIRouter(tags=["ops"])


@router.get("/healthz")
async def healthz(services: AppServices) -> JSONResponse:
    """Liveness: 200 while the engine is alive and stepping, 503 once it has died (restart the server)."""
    health = services.engine.health()
    body = {"status": "ok" if health.alive else "unhealthy", "model": services.base_model_name,
            "inflight": services.num_inflight, "api_server_pid": os.getpid(),
            "engine": {"alive": health.alive, "pid": health.pid}}
    if health.reason is not None:
        body["reason"] = health.reason
    return JSONResponse(body, status_code=200 if health.alive else 503)


@router.get("/metrics")
async def metrics(services: AppServices) -> Response:
    return Response(services.metrics.render(), media_type=CONTENT_TYPE_LATEST)
