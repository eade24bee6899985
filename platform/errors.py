"""Every failure leaves the API as an OpenAI error body with the right status.

`{"error": {"message", "type", "param", "code"}}`. The domains' errors
(engine, sessions, adapters, billing, grammar: every `DomainError`) carry no
HTTP status, only their message, parameter and stable code: `ERROR_TABLE`
below is the one place that maps each class to a status code (the body's
`type` follows from the status), most specific class first. The platform's
own errors (`ApiError`) are HTTP errors by nature and carry theirs. Request
validation becomes a 400 naming the field.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from loraplex.adapters import errors as adapter_errors
from loraplex.billing.quotas import QuotaExceededError
from loraplex.engine import errors as engine_errors
from loraplex.engine.errors import DomainError
from loraplex.platform.api.retry_hints import retry_headers
from loraplex.platform.request_context import REQUEST_ID_HEADER
from loraplex.sessions.errors import (
    SessionBusyError,
    SessionConflictError,
    SessionLimitError,
    SessionNotFoundError,
    StoredStateLimitError,
)
from loraplex.sessions.responses import ResponseNotFoundError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


# Error class -> HTTP status. Looked up along the class's MRO, so a subclass not listed takes its parent's row.
ERROR_TABLE: dict[type[Exception], int] = {
    engine_errors.PromptTooLongError: 400,  # OpenAI's: the SDK raises BadRequestError, code context_length_exceeded
    engine_errors.DuplicateRequestError: 409,
    engine_errors.InvalidRequestError: 400,  # any domain's refusal of its input
    engine_errors.EngineOverloadedError: 503,
    engine_errors.EngineDeadError: 503,
    engine_errors.EngineError: 500,
    SessionNotFoundError: 404,
    SessionBusyError: 409,
    SessionConflictError: 409,
    SessionLimitError: 429,
    StoredStateLimitError: 429,
    adapter_errors.AdapterRejectedError: 422,
    adapter_errors.UnsafeUploadError: 400,
    adapter_errors.UploadTooLargeError: 413,
    adapter_errors.UnsupportedMediaError: 415,
    adapter_errors.AdapterNotFoundError: 404,
    adapter_errors.AdapterNameTakenError: 409,
    adapter_errors.AdapterInUseError: 409,
    adapter_errors.TooManyUploadsError: 429,
    QuotaExceededError: 429,
    ResponseNotFoundError: 404,
    DomainError: 500,  # a domain's failure with no row of its own
}


def status_for(exc: BaseException) -> int:
    """The HTTP status of an error raised by any domain (ApiError: its own; unknown: 500)."""
    if isinstance(exc, ApiError):
        return exc.status
    for cls in type(exc).__mro__:
        status = ERROR_TABLE.get(cls)
        if status is not None:
            return status
    return 500


def error_type_for(status: int) -> str:
    return _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")


class ApiError(Exception):
    status = 400
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def headers(self) -> dict[str, str]:
        return {}


class AuthenticationError(ApiError):
    status = 401
    code = "invalid_api_key"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class PermissionDeniedError(ApiError):
    status = 403
    code = "insufficient_scope"


class NotFoundError(ApiError):
    status = 404
    code = "not_found"


class ConflictError(ApiError):
    status = 409
    code = "conflict"


class RateLimitedError(ApiError):
    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = max(1, retry_after_s)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class OverloadedError(ApiError):
    status = 503
    code = "overloaded"


class DependencyUnavailableError(ApiError):
    """A backing service (the database) is unreachable and nothing cached can stand in for it."""

    status = 503
    code = "service_unavailable"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "5"}


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type_for(status),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status, headers=headers)


def response_for(exc: Exception) -> JSONResponse:
    """The response for any exception raised while serving a request (also used mid-stream)."""
    if isinstance(exc, ApiError):
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.headers())
    if isinstance(exc, DomainError):
        status = status_for(exc)
        headers = {"Retry-After": "5"} if isinstance(exc, engine_errors.EngineDeadError) else retry_headers(exc.code)
        return error_response(status, exc.message, param=exc.param, code=exc.code, headers=headers)
    log.exception("unhandled error", exc_info=exc)
    return error_response(500, "internal server error", code="internal_error")


_REQUEST_PARTS = frozenset({"body", "query", "path", "header", "cookie"})


def validation_param(errors: Sequence[Mapping[str, Any]]) -> tuple[str | None, str]:
    """(param, message) for the first pydantic error: `messages[0].content`, `temperature`, ..."""
    if not errors:
        return None, "invalid request"
    first = errors[0]
    loc = list(first.get("loc", ()))
    if loc and loc[0] in _REQUEST_PARTS:  # FastAPI's prefix: `limit`, not `query.limit`, as OpenAI names it
        loc = loc[1:]
    # Pydantic adds the union member's type name to the location ("stop.str"); it is noise to a client.
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif isinstance(part, str) and part[:1].islower() and not _is_type_tag(part):
            param += ("." if param else "") + part
    message = first.get("msg", "invalid value")
    if loc == [] and isinstance(first.get("input"), bytes | str):
        # FastAPI parses a body as JSON only when it is sent as such (`curl -d` sends a form's content type).
        return None, "the request body must be a JSON object sent with 'Content-Type: application/json'"
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error")
        return None, f"the request body is not valid JSON: {reason}" if reason else "the request body is not valid JSON"
    return param or None, f"{param}: {message}" if param else message


def _is_type_tag(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "list[str]", "list[int]", "list[list[int]]", "dict", "none"} or "[" in part


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_request: Request, exc: Exception) -> JSONResponse:
        return response_for(exc)

    async def on_validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        param, message = validation_param(list(exc.errors()))
        return error_response(400, message, param=param, code="invalid_value")

    async def on_http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(DomainError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http_error)  # type: ignore[arg-type]
    async def on_unhandled_error(request: Request, exc: Exception) -> JSONResponse:
        # Starlette runs this handler outside every middleware, RequestIdMiddleware included: put the
        # request's id on the 500 here, so the one response a client most needs to report carries it.
        response = response_for(exc)
        request_id = request.scope.get("state", {}).get("request_id")
        if request_id:
            response.headers[REQUEST_ID_HEADER] = request_id
        return response

    app.add_exception_handler(Exception, on_unhandled_error)
