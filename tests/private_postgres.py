"""A PostgreSQL server of one test alone, which the test may stop and start (a database outage).

The shared server on port 5432 must never be stopped, so outage tests run
their own: `initdb` into a temporary folder, trust authentication, a free
port on 127.0.0.1 and the unix socket inside that folder. initdb and the
server refuse to run as root, so they run as the `postgres` OS user, who
owns the folder. `close()` always stops the server (immediately) and
removes the folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg
from local_serving import free_port
from waiting import wait_until

PG_BIN = Path(os.environ.get("LORAPLEX_TEST_PG_BIN", "/usr/local/bin"))
PG_OS_USER = "postgres"


class PrivatePostgres:
    def __init__(self, root: Path, port: int) -> None:
        self.root = root
        self.port = port
        self.data_dir = root / "data"
        self.socket_dir = root / "socket"
        self.log_path = root / "postgres.log"

    @property
    def url(self) -> str:
        """SQLAlchemy URL; connect_timeout keeps a client from hanging while the server is stopped."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres?connect_timeout=5"

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres connect_timeout=5"

    @classmethod
    def create(cls) -> PrivatePostgres:
        """initdb a new cluster and start it."""
        # Not under pytest's tmp_path: its parents are private to root and the postgres user must reach it.
        root = Path(tempfile.mkdtemp(prefix="lpx-pg-"))
        server = cls(root, free_port())
        try:
            server.socket_dir.mkdir()
            shutil.chown(root, PG_OS_USER, PG_OS_USER)
            shutil.chown(server.socket_dir, PG_OS_USER, PG_OS_USER)
            server._run("initdb", "-D", str(server.data_dir), "-U", "postgres", "--auth=trust",
                        "--encoding=UTF8", "--no-sync")
            server.start()
        except BaseException:
            server.close()
            raise
        return server

    def start(self, timeout_s: int = 60) -> None:
        options = " ".join([
            f"-p {self.port}",
            "-c listen_addresses=127.0.0.1",
            f"-c unix_socket_directories={self.socket_dir}",
            # Crash safety against the OS is not under test; a server process crash still loses nothing.
            "-c fsync=off",
            "-c max_connections=60",
        ])
        self._run("pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_path), "-o", options,
                  "-w", "-t", str(timeout_s), "start")

    def stop(self, mode: str = "fast", timeout_s: int = 60) -> None:
        """`fast`: disconnect every client and shut down cleanly; `immediate`: like a crash."""
        self._run("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "-t", str(timeout_s), "stop")

    @property
    def is_running(self) -> bool:
        done = subprocess.run(self._as_postgres("pg_ctl", "-D", str(self.data_dir), "status"),
                              cwd=self.root, capture_output=True)
        return done.returncode == 0

    def wait_accepting(self, timeout_s: float = 30) -> None:
        def accepting() -> bool:
            try:
                psycopg.connect(self.dsn).close()
            except psycopg.OperationalError:
                return False
            return True

        wait_until(accepting, timeout_s=timeout_s, interval_s=0.1, what=f"PostgreSQL at {self.dsn} to accept")

    def close(self) -> None:
        try:
            if self.data_dir.exists() and self.is_running:
                self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except FileNotFoundError:
            return ""

    def _as_postgres(self, program: str, *args: str) -> list[str]:
        return ["runuser", "-u", PG_OS_USER, "--", str(PG_BIN / program), *args]

    def _run(self, program: str, *args: str) -> None:
        done = subprocess.run(self._as_postgres(program, *args), cwd=self.root, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"{program} {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}\n"
                f"server log:\n{self.log_tail()}"
            )
