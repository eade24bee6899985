"""An app holding only the portal router: page shells and modules, no model, no database.

Used by the tests of the portal's own pieces (routing, headers, the SSE parser
and chart code running in Chromium); the end-to-end tests use the real app.
"""

from fastapi import FastAPI
from loraplex.platform.portal import build_portal_router


def create_app() -> FastAPI:
    app = FastAPI()
    app.include_router(build_portal_router())
    return app
