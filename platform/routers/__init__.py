"""HTTP routes. Other domains add their routers (adapters, sessions, usage) to `all_routers`."""

from __future__ import annotations

from fastapi import APIRouter


def all_routers() -> list[APIRouter]:
    from loraplex.platform.routers import (
        adapters,
        admin,
        admin_billing,
        batches,
        files,
        health,
        openai_api,
        responses,
        sessions,
        usage,
    )

    return [health.router, openai_api.router, responses.router, admin.router, admin_billing.router, usage.router,
            sessions.router, adapters.router, files.router, batches.router]
