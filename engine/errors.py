"""Typed errors the engine raises; the API layer maps each to an HTTP status."""

from __future__ import annotations


class EngineError(Exception):
    """Base class. `status` is the HTTP status the API layer should use."""

    status = 500
    code = "engine_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(EngineError):
    status = 400
    code = "invalid_request"


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) can never fit the context or the KV pool."""

    status = 413
    code = "context_length_exceeded"


class DuplicateRequestError(InvalidRequestError):
    status = 409
    code = "duplicate_request_id"


class EngineOverloadedError(EngineError):
    status = 503
    code = "overloaded"


class EngineDeadError(EngineError):
    status = 503
    code = "engine_unavailable"
