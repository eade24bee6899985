"""Typed errors. They say what went wrong, never how a web API reports it: the platform's one error
table (platform/errors.py) maps each class to a status code.

`DomainError` and `InvalidRequestError` are the roots every domain's errors share (sessions, billing,
adapters and grammar define theirs next to their code); they live here because every domain already
depends on the engine's interfaces. `EngineError` and its subclasses are the engine's own failures.
"""

from __future__ import annotations


class DomainError(Exception):
    """Base class of every domain's errors; `code` is a stable machine-readable name for the failure and
    `param` the request field at fault, if one is."""

    code = "error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(DomainError):
    """What the caller sent is refused (a malformed field, a limit passed), by whichever domain checks it."""

    code = "invalid_request"


class EngineError(DomainError):
    """The engine failed (not the caller's input)."""

    code = "engine_error"


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
