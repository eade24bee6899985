"""CORS for browser apps on other origins: off unless `Settings.cors_allowed_origins` names some.

Installed outermost, so a browser's preflight (an OPTIONS request without an
API key) is answered before the edge checks would refuse it as unauthenticated.
Credentials (cookies) are never allowed: the API authenticates by bearer key.
"""

from __future__ import annotations

from fastapi import FastAPI
from loraplex.platform.request_context import REQUEST_ID_HEADER
from loraplex.platform.settings import Settings
from starlette.middleware.cors import CORSMiddleware

# What a browser app may read from responses: the request id to report, and retry/limit hints.
EXPOSED_HEADERS = [REQUEST_ID_HEADER, "retry-after", "x-should-retry"]


def install_cors(app: FastAPI, settings: Settings) -> None:
    if not settings.cors_allowed_origins:
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=settings.cors_allowed_origins,
        allow_methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"],
        allow_headers=["*"],
        expose_headers=EXPOSED_HEADERS,
        allow_credentials=False,
        max_age=600,
    )
