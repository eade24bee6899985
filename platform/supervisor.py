"""`loraplex serve`'s process layout: one engine-core process, N API server processes, this supervisor.

    supervisor (this process: binds the port, starts and watches the others)
      ├── engine core      model, KV cache, scheduler, LoRA slots, grammar masks, session pins
      └── API server × N   uvicorn apps sharing the port; each talks to the core over ZeroMQ

If the engine core dies, every API server ends its open requests with a 503
at once (its client watches the core) and reports unhealthy on /healthz; the
supervisor then stops the API servers cleanly (usage already metered is
flushed) and exits non-zero, so an orchestrator restarts the whole server.
An API server that dies takes the server down the same way. SIGTERM drains:
the API servers stop accepting, finish in-flight requests for up to
`drain_timeout_s`, flush their meters, and only then is the core stopped.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker
from multiprocessing.process import BaseProcess
from typing import Any

import uvicorn
from loraplex.engine.errors import EngineDeadError
from loraplex.engine.process_lifetime import die_with_parent
from loraplex.platform.engine_process import (
    EngineCoreProcess,
    ignore_ctrl_c,
    start_engine_core,
)
from loraplex.platform.settings import Settings
from loraplex.platform.startup_heap import freeze_startup_heap

log = logging.getLogger(__name__)

# After the core dies, the API servers keep answering (503s, an unhealthy /healthz) this long before they stop,
# so clients and probes see a clear error rather than a refused connection.
CORE_DEATH_GRACE_S = 3.0
# Once the core is dead the batch worker has nothing to finish (its lines are leased and run again after a
# restart), and one still starting waits for the dead core's handshake with SIGTERM held behind it: it gets this
# long, not the drain timeout.
BATCH_WORKER_CORE_DEAD_GRACE_S = 3.0
BATCH_WORKER_NAME = "loraplex-batch-worker"
_POLL_S = 0.2


def run_api_server(settings: Settings, sock: socket.socket) -> None:
    """One API server process: the app on the shared listening socket, its engine the core's client."""
    die_with_parent()
    ignore_ctrl_c()
    keep_the_loop_responsive()
    from loraplex.platform.app import create_app
    from loraplex.platform.request_context import configure_logging

    configure_logging(settings.log_level)
    app = create_app(settings)
    config = uvicorn.Config(app, log_config=None, access_log=True, timeout_keep_alive=settings.keep_alive_timeout_s,
                            timeout_graceful_shutdown=int(settings.drain_timeout_s) or None)
    DrainingServer(config, app, freeze_heap=settings.freeze_startup_heap).run(sockets=[sock])


def run_batch_worker(settings: Settings, socket_path: str) -> None:
    """The batch-worker process: the same app, listening only on a private Unix socket, so that its lifespan
    runs the batch worker (claiming, running and metering batches) on an event loop no client request shares."""
    die_with_parent()
    ignore_ctrl_c()
    keep_the_loop_responsive()
    from loraplex.platform.app import create_app
    from loraplex.platform.request_context import configure_logging

    configure_logging(settings.log_level)
    app = create_app(settings)
    config = uvicorn.Config(app, uds=socket_path, log_config=None, access_log=False,
                            timeout_graceful_shutdown=int(settings.drain_timeout_s) or None)
    DrainingServer(config, app, freeze_heap=settings.freeze_startup_heap).run()


def keep_the_loop_responsive() -> None:
    """An API server's event loop must not wait behind its own background threads (meter, database, upload pool).

    A call that releases the GIL (the Rust tokenizer, a socket send) must take it back before the loop goes on;
    with the default 5 ms switch interval, a busy background thread made each tokenizer call on the loop cost
    ~5 ms instead of ~0.1 ms (py-spy, max_tokens=1 requests). So: a 0.5 ms switch interval, and the tokenizer
    encodes in the calling thread (no hand-off to its own thread pool for one short prompt; long prompts are
    tokenized in a worker thread anyway).
    """
    sys.setswitchinterval(0.0005)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # An API server does no tensor math worth a thread pool; N of them each spinning torch's OpenMP pool (all
    # cores by default) would take cores from the engine core.
    import torch

    torch.set_num_threads(1)


class DrainingServer(uvicorn.Server):
    """uvicorn drains on SIGTERM (stops accepting, finishes in-flight requests); this also marks the app as
    draining, so /readyz turns 503 at once and load balancers stop sending to it."""

    def __init__(self, config: uvicorn.Config, app: Any, *, freeze_heap: bool = False) -> None:
        super().__init__(config)
        self._app = app
        self._freeze_heap = freeze_heap

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit and self._freeze_heap:  # started: the app's services are built
            freeze_startup_heap("API server")

    def handle_exit(self, sig: int, frame: Any) -> None:
        services = getattr(self._app.state, "services", None)
        if services is not None:
            services.draining = True
        super().handle_exit(sig, frame)


def bind_socket(host: str, port: int, *, unread_timeout_s: float = 0.0) -> socket.socket:
    """The API servers' shared listening socket. `unread_timeout_s`: TCP_USER_TIMEOUT, which accepted connections
    inherit: the kernel closes a connection whose sent data has waited that long unacknowledged or untaken (a
    client that stopped reading, a peer gone without a FIN). Without it, a response the app gave up on stays in
    the event loop's write buffer, holding its connection and memory, for as long as the client keeps the
    connection open and reads nothing."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if unread_timeout_s > 0 and hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(unread_timeout_s * 1000))
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


@contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Start children here. Ctrl-C reaches the whole process group; a child started inside starts with SIGINT
    blocked (a KeyboardInterrupt in the middle of its interpreter's start-up printed a fatal-error traceback) and
    ignores it until it serves (`ignore_ctrl_c`), and one sent meanwhile waits here, blocked, and reaches the
    supervisor the moment the block ends. multiprocessing starts its resource tracker with the first child and
    unblocks SIGINT and SIGTERM after it, which would lift this block for the children after it: it starts first."""
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.core: EngineCoreProcess | None = None
        self.api_servers: list[BaseProcess] = []  # and the batch worker, once started
        self._api_settings = settings
        self._stopping = False

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (exit 0) or until a process dies (exit 1)."""
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        try:
            # a port in use fails here, before the model loads
            sock = bind_socket(self.settings.host, self.settings.port,
                               unread_timeout_s=self.settings.stream_send_timeout_s)
        except OSError as exc:
            log.error("cannot listen on %s:%d: %s", self.settings.host, self.settings.port, exc.strerror or exc)
            return 1
        # The supervisor migrated already: N servers must not race to. Their metrics meet in one directory.
        metrics_dir = tempfile.mkdtemp(prefix="loraplex-metrics-")
        try:
            with ctrl_c_held():
                self.core = start_engine_core(self.settings)
                self._start_api_servers(sock, metrics_dir)
            try:
                ready = self.core.wait_ready(self.settings.engine_core_start_timeout_s,
                                             cancelled=lambda: self._stopping)
            except EngineDeadError as exc:
                log.error("%s", exc)
                ready = None
            if not ready:
                if ready is False:
                    log.info("stopped before the engine core was ready")
                # Nothing to drain: they have served nothing, and wait for the core's handshake (SIGTERM waits
                # behind it), so they are killed after a short grace.
                self._stop_api_servers(2)
                self.core.stop()
                return 0 if ready is False else 1
            self._start_batch_worker(metrics_dir)
            log.info("engine core pid %d ready; %s", self.core.pid,
                     ", ".join(f"{p.name} pid {p.pid}" for p in self.api_servers))
            return self._watch()
        finally:
            sock.close()
            shutil.rmtree(metrics_dir, ignore_errors=True)

    def _start_api_servers(self, sock: socket.socket, metrics_dir: str) -> None:
        """Started with the core, not after it: each imports and builds its app while the core loads the model,
        then waits for the core's handshake before it listens (that used to add ~8 s to every start)."""
        assert self.core is not None
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by prometheus_client in each API server
        api_settings = self.settings.model_copy(update={"engine_core_address": self.core.address,
                                                        "migrate_on_start": False,
                                                        "metrics_multiprocess_dir": metrics_dir})
        context = multiprocessing.get_context("spawn")
        route_settings = api_settings.model_copy(update={"batch_workers_enabled": False}) \
            if self._runs_a_batch_worker() else api_settings
        for index in range(self.settings.num_api_servers):
            process = context.Process(target=run_api_server, args=(route_settings, sock),
                                      name=f"loraplex-api-{index}")
            process.start()
            self.api_servers.append(process)
        self._api_settings = api_settings

    def _runs_a_batch_worker(self) -> bool:
        return self.settings.batch_workers_enabled and self.settings.batch_worker_process

    def _start_batch_worker(self, metrics_dir: str) -> None:
        """Once the core is ready: started with the API servers, a process still importing Python's own
        modules when Ctrl-C came printed a KeyboardInterrupt traceback over the quiet stop."""
        if not self._runs_a_batch_worker():
            return
        process = multiprocessing.get_context("spawn").Process(
            target=run_batch_worker, name=BATCH_WORKER_NAME,
            args=(self._api_settings, os.path.join(metrics_dir, "batch-worker.sock")))
        with ctrl_c_held():
            process.start()
        self.api_servers.append(process)  # watched and drained as the API servers are

    def _watch(self) -> int:
        assert self.core is not None
        while True:
            if self._stopping:
                log.info("draining: stopping the API servers (up to %.0f s), then the engine core",
                         self.settings.drain_timeout_s)
                self._stop_api_servers(self.settings.drain_timeout_s + 10)
                self.core.stop()
                return 0
            if not self.core.is_alive():
                log.error("the engine core died (exit code %s); in-flight requests end with 503; exiting",
                          self.core.process.exitcode)
                self._sleep(CORE_DEATH_GRACE_S)
                self._stop_api_servers(self.settings.drain_timeout_s + 10,
                                       batch_worker_timeout_s=BATCH_WORKER_CORE_DEAD_GRACE_S)
                return 1
            dead = [p for p in self.api_servers if not p.is_alive()]
            if dead:
                log.error("API server %s exited (code %s); stopping the server", dead[0].name, dead[0].exitcode)
                self._stop_api_servers(self.settings.drain_timeout_s + 10)
                self.core.stop()
                return 1
            time.sleep(_POLL_S)

    def _stop_api_servers(self, timeout_s: float, batch_worker_timeout_s: float | None = None) -> None:
        for process in self.api_servers:
            if process.is_alive():
                process.terminate()  # uvicorn drains on SIGTERM
        started = time.monotonic()
        deadline = started + timeout_s
        for process in self.api_servers:
            own_deadline = deadline
            if batch_worker_timeout_s is not None and process.name == BATCH_WORKER_NAME:
                own_deadline = min(deadline, started + batch_worker_timeout_s)
            process.join(max(own_deadline - time.monotonic(), 0.1))
            if process.is_alive():
                log.warning("API server %s did not stop in time; killing it", process.name)
                process.kill()
                process.join(5)

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self._stopping:
            time.sleep(_POLL_S)

    def _request_stop(self, _signum: int, _frame: Any) -> None:
        self._stopping = True
