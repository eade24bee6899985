"""The FastAPI application factory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from loraplex.platform.api.cors import install_cors
from loraplex.platform.api.request_limits import RequestLimits
from loraplex.platform.batches.worker import install_batches
from loraplex.platform.body_limit import BodyLimits
from loraplex.platform.edge import EdgeMiddleware
from loraplex.platform.errors import install_error_handlers
from loraplex.platform.metrics import Metrics
from loraplex.platform.portal import build_portal_router
from loraplex.platform.routers import all_routers
from loraplex.platform.settings import Settings
from loraplex.platform.wiring import build_services, close_services


def create_app(settings: Settings | None = None, engine: Any | None = None) -> FastAPI:
    """An app serving `settings`' model, or `engine` when given (tests share one engine between apps).

    The engine and database are set up at start-up (lifespan), not at import,
    so `create_app()` is cheap and `loraplex serve` can report progress.
    """
    settings = settings or Settings()
    metrics = Metrics(settings.metrics_multiprocess_dir)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = build_services(settings, engine, metrics=metrics)
        app.state.services = services
        install_batches(services)  # the Batch API's store and this process's batch worker
        try:
            yield
        finally:
            await close_services(services)

    app = FastAPI(title="loraplex", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    for router in all_routers():
        app.include_router(router)
    app.include_router(build_portal_router())  # the tenant portal: /portal pages and /portal/static
    limits = BodyLimits(max_body_bytes=settings.max_request_body_bytes,
                        max_upload_bytes=settings.max_upload_request_bytes,
                        request_limits=RequestLimits.from_settings(settings), max_tools=settings.grammar_max_tools)
    # One pure-ASGI layer for request id, edge limits, metrics and slow readers (platform/edge.py).
    app.add_middleware(EdgeMiddleware, limits=limits, metrics=metrics, send_timeout_s=settings.stream_send_timeout_s)
    install_cors(app, settings)  # outermost, and only when configured: preflights carry no API key
    return app
