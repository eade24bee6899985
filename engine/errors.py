"""Typed errors the engine raises. They say what went wrong, never how a web API reports it:
the platform's one error table (platform/errors.py) maps each class to a status code."""

from __future__ import annotations


class EngineError(Exception):
    """Base class; `code` is a stable machine-readable name for the failure."""

    code = "engine_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(EngineError):
    code = "invalid_request"


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) can never fit the context or the KV pool."""

    code = "context_length_exceeded"


class DuplicateRequestError(InvalidRequestError):
    code = "duplicate_request_id"


class EngineOverloadedError(EngineError):
    code = "overloaded"


class EngineDeadError(EngineError):
    """The engine (its loop, or its whole process) has stopped; nothing sent to it will be answered."""

    code = "engine_unavailable"
