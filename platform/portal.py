"""The tenant portal: server-rendered page shells under `/portal`, static assets under `/portal/static`.

The pages hold no tenant data. The browser keeps the tenant's API key in
sessionStorage and the page's ES module calls the public `/v1` API with it,
so the portal has exactly the powers of the key and needs no cookie session,
no CSRF token and no server-side state of its own.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from loraplex.platform.api.strict_json import StrictJSONRoute
from starlette.types import Scope

DEFAULT_WEB_DIR = Path(__file__).resolve().parents[1] / "web"

# path segment -> (template, title); the nav shows them in this order
_PAGES = {
    "adapters": ("adapters.html", "Adapters"),
    "playground": ("playground.html", "Playground"),
    "usage": ("usage.html", "Usage"),
    "batches": ("batches.html", "Batches"),
}

# The shells are static apart from the root path; a strict policy keeps any
# injected markup from running or calling out (everything is served locally).
_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class RevalidatedStaticFiles(StaticFiles):
    """Asset names carry no content hash, so browsers must revalidate (a cheap 304) before reusing
    a cached copy; otherwise a deploy could pair new page shells with yesterday's modules."""

    def file_response(
        self, full_path: str | os.PathLike[str], stat_result: os.stat_result, scope: Scope, status_code: int = 200
    ) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response


def build_portal_router(web_dir: Path = DEFAULT_WEB_DIR) -> APIRouter:
    """Register with `app.include_router(build_portal_router())`; no prefix needed."""
    templates = Jinja2Templates(directory=web_dir / "templates")
    router = APIRouter(include_in_schema=False, route_class=StrictJSONRoute)
    router.mount("/portal/static", RevalidatedStaticFiles(directory=web_dir / "static"), name="portal-static")

    def render(request: Request, template: str, *, page: str, title: str) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        context = {"page": page, "title": title, "root": root, "static": f"{root}/portal/static", "pages": _PAGES}
        return templates.TemplateResponse(request, template, context, headers=_SECURITY_HEADERS)

    @router.get("/portal")
    @router.get("/portal/")
    def portal_home(request: Request) -> RedirectResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return RedirectResponse(f"{root}/portal/adapters", status_code=307)

    @router.get("/portal/signin", response_class=HTMLResponse)
    def signin_page(request: Request) -> HTMLResponse:
        return render(request, "signin.html", page="signin", title="Sign in")

    def add_page(segment: str, template: str, title: str) -> None:
        def page(request: Request) -> HTMLResponse:
            return render(request, template, page=segment, title=title)

        router.add_api_route(f"/portal/{segment}", page, methods=["GET"], response_class=HTMLResponse,
                             name=f"portal-{segment}")

    for segment, (template, title) in _PAGES.items():
        add_page(segment, template, title)
    return router
