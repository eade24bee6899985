"""Small HTTP helpers for the e2e tests (plain httpx, to see statuses, headers and bodies as sent)."""

from __future__ import annotations

from typing import Any

import httpx

MODEL = "SmolLM2-135M-Instruct"
HELLO = [{"role": "user", "content": "Name three colours."}]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def post(server: Any, path: str, body: dict[str, Any], key: str | None, timeout: float = 120) -> httpx.Response:
    headers = auth(key) if key is not None else {}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=timeout)


def chat_body(**overrides: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 2, "temperature": 0, **overrides}


def assert_openai_error(response: httpx.Response, status: int, *, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    assert response.headers["x-request-id"].startswith("req_")
    return error
