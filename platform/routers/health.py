"""Liveness and Prometheus metrics (no auth: scraped by infrastructure)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from loraplex.platform.deps import AppServices
from prometheus_client import CONTENT_TYPE_LATEST

router = APIRouter(tags=["ops"])


@router.get("/healthz")
async def healthz(services: AppServices) -> dict:
    return {"status": "ok", "model": services.base_model_name, "inflight": services.num_inflight}


@router.get("/metrics")
async def metrics(services: AppServices) -> Response:
    return Response(services.metrics.render(), media_type=CONTENT_TYPE_LATEST)
