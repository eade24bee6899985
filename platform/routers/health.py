"""Liveness (/healthz), readiness (/readyz) and Prometheus metrics (probed by infrastructure: no API key)."""

from __future__ import annotations

import asyncio
import os

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from loraplex.platform.api.strict_json import StrictJSONRoute
from loraplex.platform.deps import AppServices
from loraplex.platform.metrics_vllm import check_metrics_token
from loraplex.platform.readiness import check_readiness
from prometheus_client import CONTENT_TYPE_LATEST

router = APIRouter(tags=["ops"], route_class=StrictJSONRoute)


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


@router.get("/readyz")
async def readyz(services: AppServices) -> JSONResponse:
    """Readiness: 200 when this server should get traffic; 503 naming what is not ready (platform/readiness.py)."""
    readiness = await check_readiness(services)
    body: dict = {"status": "ready" if readiness.ready else "not_ready", "not_ready": readiness.not_ready}
    if readiness.notes:
        body["notes"] = readiness.notes
    return JSONResponse(body, status_code=200 if readiness.ready else 503)


@router.get("/metrics")
async def metrics(services: AppServices, request: Request) -> Response:
    """Ours and vLLM's names (platform/metrics_vllm.py); with `metrics_bearer_token` set, only with it."""
    check_metrics_token(request.headers.get("authorization"), services.settings.metrics_bearer_token)
    return Response(await asyncio.to_thread(services.metrics.render), media_type=CONTENT_TYPE_LATEST)
