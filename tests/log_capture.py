"""Capture the log records a server emits, from loggers that may not propagate to the root (uvicorn's)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class CapturedRecords(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def captured_logs(*logger_names: str, level: int = logging.DEBUG) -> Iterator[CapturedRecords]:
    """Records at `level` or above from the root logger and `logger_names`, while the block runs."""
    handler = CapturedRecords(level)
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in logger_names)]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
