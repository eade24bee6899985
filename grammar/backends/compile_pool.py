"""Compilations in worker processes that can be killed: a time limit that actually stops the work.

A thread cannot be stopped in Python, and a native compiler may run for
minutes on a hostile schema. Each worker is a child interpreter
(`python -P -m loraplex.grammar.backends.compile_worker`, so it never imports the
parent's main module nor the repository's folders) that builds its compiler
once from `setup(*setup_args)` and then answers jobs over its stdin/stdout.
A job that runs past its time kills its worker; the next job starts a fresh
one. Jobs wait for a free worker at most `queue_timeout_s`.
"""

from __future__ import annotations

import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

_HEADER = struct.Struct("!Q")


class CompileQueueTimeout(TimeoutError):
    """No worker became free in time."""


def write_message(stream: IO[bytes], value: Any) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def read_message(stream: IO[bytes]) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    return pickle.loads(stream.read(size))


class _Worker:
    def __init__(self, setup: Callable[..., Any], setup_args: tuple[Any, ...], startup_timeout_s: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-m", "loraplex.grammar.backends.compile_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=os.path.dirname(sys.executable) or "/",
        )
        if self.process.stdin is None or self.process.stdout is None:  # never: both are PIPE
            raise RuntimeError("the compile worker started without its pipes")
        self.stdin: IO[bytes] = self.process.stdin
        self.stdout: IO[bytes] = self.process.stdout
        write_message(self.stdin, (setup, setup_args))
        if self.receive(startup_timeout_s) != ("ready", None):
            self.kill()
            raise RuntimeError("the compile worker did not start")

    def receive(self, timeout_s: float) -> Any:
        """The next message, or None if none came within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        stdout = self.stdout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([stdout], [], [], remaining)
            if ready:
                return read_message(stdout)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=5)
        for stream in (self.stdin, self.stdout):
            stream.close()


class ProcessCompilePool:
    """Up to `num_workers` child processes; `run(request, timeout_s)` is thread-safe and blocking."""

    def __init__(self, setup: Callable[..., Any], setup_args: tuple[Any, ...], num_workers: int,
                 queue_timeout_s: float, startup_timeout_s: float = 120.0) -> None:
        self._setup, self._setup_args = setup, setup_args
        self._queue_timeout_s = queue_timeout_s
        self._startup_timeout_s = startup_timeout_s
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(num_workers):
            self._idle.put(None)  # a slot; its worker starts on first use
        self._closed = threading.Event()
        self.num_killed = 0

    def run(self, request: Any, timeout_s: float) -> Any:
        try:
            worker = self._idle.get(timeout=self._queue_timeout_s)
        except queue.Empty:
            raise CompileQueueTimeout(f"no compile worker was free within {self._queue_timeout_s:g}s") from None
        try:
            if worker is None or worker.process.poll() is not None:
                worker = _Worker(self._setup, self._setup_args, self._startup_timeout_s)
            write_message(worker.stdin, request)
            answer = worker.receive(timeout_s)
            if answer is None:
                worker.kill()
                worker = None
                self.num_killed += 1
        except (EOFError, OSError):
            if worker is not None:
                worker.kill()
            worker = None
            raise RuntimeError("the compile worker died") from None
        finally:
            self._idle.put(None if self._closed.is_set() else worker)
        if answer is None:
            raise TimeoutError(f"compilation ran past {timeout_s:g}s and was stopped")
        status, value = answer
        if status == "error":
            raise ValueError(value)
        return value

    def close(self) -> None:
        self._closed.set()
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()
