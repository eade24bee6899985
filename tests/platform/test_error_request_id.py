"""An unhandled error is a 500 in the OpenAI error shape that still carries the request's id."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient
from loraplex.platform.body_limit import BodyLimits
from loraplex.platform.edge import EdgeMiddleware
from loraplex.platform.errors import install_error_handlers
from loraplex.platform.request_context import REQUEST_ID_HEADER


def test_unhandled_error_is_a_500_with_the_request_id():
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(EdgeMiddleware, limits=BodyLimits(max_body_bytes=1 << 20, max_upload_bytes=1 << 20))

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/boom")
    assert response.status_code == 500
    assert response.json()["error"] == {"message": "internal server error", "type": "server_error", "param": None,
                                        "code": "internal_error"}
    assert response.headers[REQUEST_ID_HEADER].startswith("req_")
