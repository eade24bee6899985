"""Typed session errors; the platform's error table maps each to an HTTP status."""

from __future__ import annotations

from loraplex.engine.errors import DomainError, InvalidRequestError


class SessionNotFoundError(DomainError):
    """Unknown, expired, deleted, or another tenant's session (never say which)."""

    code = "session_not_found"

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"Session {session_id!r} was not found: it never existed, expired, or was deleted. "
            "Create a new session with POST /v1/sessions.",
            param="session_id",
        )
        self.session_id = session_id


class SessionBusyError(DomainError):
    """Another turn of this session is running; turns are one at a time."""

    code = "session_busy"

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"Session {session_id!r} is already running a turn; send the next turn after it completes.",
            param="session_id",
        )


class SessionLimitError(DomainError):
    """The tenant already holds as many live sessions as it may; deleting one (or letting one expire) frees room."""

    code = "session_limit_exceeded"

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"this tenant already has {limit} live sessions (max_sessions_per_tenant); delete one with "
            "DELETE /v1/sessions/{id} or let one expire, then retry",
        )


class SessionConflictError(DomainError):
    """The turn's lease was lost (it ran past the lease time) and the session moved on without it."""

    code = "session_conflict"

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"Session {session_id!r} changed while this turn ran (its lease expired); the turn was not recorded.",
            param="session_id",
        )


class StoredStateLimitError(DomainError):
    """A tenant's stored responses or sessions are at a per-tenant count or bytes cap (the message names the
    setting); deleting some, or letting them expire, frees room."""

    code = "stored_state_limit_exceeded"


class StoredStateTooLargeError(InvalidRequestError):
    """One stored response or session would be larger than the per-record cap the message names."""

    code = "stored_state_too_large"
