"""`loraplex serve` as a real subprocess, for tests that kill, restart or run several servers.

`ServerProcess` owns one process: a free port, its environment, a log file
(stdout and stderr) in a temporary folder, waiting for /healthz, SIGKILL (a
crash: no shutdown hooks run) and terminate (a clean stop). `loraplex serve`
is a supervisor with an engine-core process and API server processes under
it; the server runs in its own process group, so a kill reaches all of them. `start()` may be
called again after a stop to restart on a new port with the same
environment, which is how a crashed server "comes back". Used as a context
manager it always stops the process, and prints the end of its log when the
block fails, so a server-side traceback shows up in the test report.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
from local_serving import free_port
from loraplex.engine.process_lifetime import die_with_parent
from waiting import wait_until


def _accepts_connections(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVE_COMMAND = [sys.executable, "-m", "loraplex.platform.cli.main", "serve"]



def server_env(
    *,
    database_url: str,
    data_dir: Path,
    model_path: Path,
    redis_url: str | None = None,
    redis_key_prefix: str | None = None,
    kv_cache_memory_mb: int = 32,
    log_level: str = "info",
    **settings: Any,
) -> dict[str, str]:
    """The environment of one server: this process's, minus any LORAPLEX_ setting it would inherit.

    Extra keyword settings become `LORAPLEX_<NAME>` variables (`billing_journal_lease_s=2`). The engine core
    computes on one thread: on the two cores the suite shares with the server's other processes and the
    test's clients, a second spinning OpenMP thread cost far more than it gave (a load phase took 3-10x longer).
    """
    env = {name: value for name, value in os.environ.items() if not name.startswith("LORAPLEX_")}
    env.update({
        "LORAPLEX_DATABASE_URL": database_url,
        "LORAPLEX_MODEL_PATH": str(model_path),
        "LORAPLEX_DATA_DIR": str(data_dir),
        "LORAPLEX_KV_CACHE_MEMORY_MB": str(kv_cache_memory_mb),
        "LORAPLEX_DEVICE": "cpu",
        "LORAPLEX_LOG_LEVEL": log_level,
        "LORAPLEX_ENGINE_CPU_THREADS": "1",
    })
    if redis_url is not None:
        env["LORAPLEX_REDIS_URL"] = redis_url
        if redis_key_prefix is not None:
            env["LORAPLEX_REDIS_KEY_PREFIX"] = redis_key_prefix
    env.update({f"LORAPLEX_{name.upper()}": str(value) for name, value in settings.items()})
    return env


class ServerProcess:
    def __init__(self, env: dict[str, str], log_dir: Path, *, name: str = "server") -> None:
        self.env = env
        self.name = name
        self.log_dir = log_dir
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.num_starts = 0
        self.log_paths: list[Path] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError(f"{self.name} is not running")
        return self.process.pid

    @property
    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, *, wait: bool = True, timeout_s: float = 180) -> ServerProcess:
        if self.is_running:
            raise RuntimeError(f"{self.name} is already running")
        self.num_starts += 1
        self.port = free_port()
        log_path = self.log_dir / f"{self.name}-{self.num_starts}.log"
        self.log_paths.append(log_path)
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [*SERVE_COMMAND, "--port", str(self.port)],
                cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent,  # a test run killed mid-way leaves no server behind
            )
        if wait:
            self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float = 180) -> None:
        def healthy() -> bool:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"{self.name} exited with {code} before it was healthy:\n{self.log_tail()}")
            try:
                return httpx.get(self.url + "/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout_s=timeout_s, interval_s=0.1,
                   what=lambda: f"{self.name} at {self.url} to become healthy:\n{self.log_tail()}")

    def health(self) -> dict[str, Any]:
        return httpx.get(self.url + "/healthz", timeout=5).json()

    def kill(self) -> None:
        """SIGKILL to every process of the server, like a crash or the OOM killer: nothing gets to run afterwards."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process = None
        # The children sharing the listening socket die a moment after the supervisor; until the last has, the
        # kernel still accepts connections that then end with no response (a balancer's 502, not a retry).
        wait_until(lambda: not _accepts_connections(self.port), what=f"{self.name}'s port to close", timeout_s=30)

    def engine_core_pid(self) -> int:
        return int(self.health()["engine"]["pid"])

    def terminate(self, timeout_s: float = 30) -> bool:
        """SIGTERM (a clean shutdown: hooks run), SIGKILL if it takes over `timeout_s`; False in that case."""
        if self.process is None:
            return True
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                return False
        with contextlib.suppress(ProcessLookupError):  # a child the supervisor left behind (it never should)
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process = None
        return True

    def log_tail(self, num_chars: int = 6000) -> str:
        parts = []
        for path in self.log_paths:
            try:
                text = path.read_text(errors="replace")
            except FileNotFoundError:
                continue
            parts.append(f"--- {path.name} ---\n{text[-num_chars:]}")
        return "\n".join(parts)

    def print_log(self) -> None:
        print(f"\n===== log of {self.name} (logs in {self.log_dir}) =====\n{self.log_tail()}", file=sys.stderr)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.terminate()
        if exc_type is not None:
            self.print_log()
