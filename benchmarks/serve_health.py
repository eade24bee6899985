"""Waiting for a `loraplex serve` the benchmark started: its /healthz, or the log's tail when it dies first."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx

LOG_TAIL_CHARS = 4000


def wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float = 900) -> None:
    """Until `url` (a server's /healthz) answers 200. SystemExit with the end of `log` if `process` exits first
    or `timeout_s` passes: a benchmark cannot go on without its server, and its log says why."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url}: the server exited with {process.returncode}:\n{_tail(log)}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer in {timeout_s:g} s:\n{_tail(log)}")


def _tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError as exc:
        return f"(the log {log} could not be read: {exc})"
