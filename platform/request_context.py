"""A request id on every response (`x-request-id`, set by the edge: platform/edge.py) and every log line of
that request."""

from __future__ import annotations

import logging
import secrets
from contextvars import ContextVar

REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID_HEADER_BYTES = REQUEST_ID_HEADER.encode()
current_request_id: ContextVar[str] = ContextVar("current_request_id", default="-")


def new_request_id() -> str:
    return "req_" + secrets.token_hex(12)


class RequestIdLogFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id.get()
        return True


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def configure_logging(level: str) -> None:
    """Root logging with the request id in every line (uvicorn's loggers included)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(RequestIdLogFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
