"""`make serve` exactly as a newcomer runs it, in a fresh working directory.

The working directory stands in for a fresh checkout: `.venv` and `Makefile` are links to this
checkout's (the install is not repeated: `make -o` treats its stamp as done), and `data/models/`
links the already converted bundled model, so the first start skips the slow GGUF conversion.
Everything else is what `make serve` does on its own: the default settings (no `LORAPLEX_*`
variable but the port the Makefile sets), a relative `./data` directory, SQLite created and
migrated on start, no Redis (rate limits, sessions and adapter validation in-process) and the
demo tenant whose key is printed once.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import httpx
from local_serving import free_port
from waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[1]
CONVERTED_MODEL = REPO_ROOT / "data" / "models" / "SmolLM2-135M-Instruct"
INSTALL_STAMP = ".venv/.loraplex-installed"
DEMO_KEY = re.compile(r"^\s+(lpx_[A-Za-z0-9_-]{20,})\s*$", re.MULTILINE)
# Variables the test process has that a newcomer's shell would not (TRITON_INTERPRET is set by tests/conftest.py).
NOT_INHERITED = ("LORAPLEX_", "TRITON_INTERPRET", "PYTEST_", "COV_")



def newcomer_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(NOT_INHERITED)}


def prepare_checkout(workdir: Path) -> Path:
    """A working directory that looks like a checkout after `make install` and the model conversion."""
    from loraplex.engine.model.default_model import ensure_default_model

    ensure_default_model(CONVERTED_MODEL.parent)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / ".venv").symlink_to(REPO_ROOT / ".venv")
    (workdir / "Makefile").symlink_to(REPO_ROOT / "Makefile")
    (workdir / "pyproject.toml").symlink_to(REPO_ROOT / "pyproject.toml")
    (workdir / "data" / "models").mkdir(parents=True)
    (workdir / "data" / "models" / CONVERTED_MODEL.name).symlink_to(CONVERTED_MODEL)
    return workdir


class MakeServe:
    """`make serve PORT=<free port>` in `workdir`, its output in `workdir/make-serve.log`."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.log_path = workdir / "make-serve.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.key = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        return ["make", "-o", INSTALL_STAMP, "serve", f"PORT={self.port}"]

    def get(self, path: str, *, key: str | None = None, **params: object) -> httpx.Response:
        """GET `path` with the demo key (or `key`); fails the test on an error status."""
        response = httpx.get(f"{self.url}{path}", params=params, timeout=30,
                             headers={"Authorization": f"Bearer {key or self.key}"})
        response.raise_for_status()
        return response

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, timeout_s: float = 600) -> MakeServe:
        with self.log_path.open("wb") as log:
            # a session of its own, so stopping it reaches make's children (the server) too
            self.process = subprocess.Popen(self.command, cwd=self.workdir, env=newcomer_env(), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

        def healthy() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"make serve exited with {self.process.returncode}:\n{self.log()[-6000:]}")
            try:
                return httpx.get(self.url + "/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(healthy, timeout_s=timeout_s, interval_s=0.2,
                       what=lambda: f"make serve to answer on {self.url}:\n{self.log()[-6000:]}")
        except TimeoutError:
            self.stop()
            raise
        found = DEMO_KEY.search(self.log())
        if found is None:
            self.stop()
            raise RuntimeError(f"make serve printed no demo key:\n{self.log()[-6000:]}")
        self.key = found.group(1)
        return self

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
