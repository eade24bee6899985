"""The engine-core process as the platform starts it: what it owns, and how an API server reaches it.

`start_engine_core` spawns a process running `run_engine_core`: it loads the
model, builds the LoRA manager over the adapter store and the grammar
compiler, and runs `EngineCore` on an IPC socket. `connect_engine` is the API
server's side: the tokenizer and model config from the same model folder,
and a `MultiProcessEngineClient` on the socket. The socket lives in a private
folder (0700) with a secret (0600) the core requires of every client: another
local user can neither connect nor, past the folder, be heard.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from loraplex.engine.core.mp_client import MultiProcessEngineClient, handshake
from loraplex.engine.errors import EngineDeadError
from loraplex.engine.process_lifetime import die_with_parent
from loraplex.platform.settings import Settings

log = logging.getLogger(__name__)


# How the supervisor stops the engine core. Not SIGTERM: that one also reaches the core when it is sent to the whole
# process group (systemd's default KillMode, `kill -TERM -<pgid>`, a terminal's job control) while the API servers
# are still draining their in-flight requests through it, and the core must outlive them.
CORE_STOP_SIGNAL = signal.SIGUSR1


def ignore_ctrl_c() -> None:
    """A child of `serve` starts with SIGINT blocked (see Supervisor.run): ignore it from here (the supervisor
    stops its children itself) and unblock it, so a server that installs its own handler later gets it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


SECRET_NAME = "core.secret"


def new_core_address() -> str:
    """A socket in a new private folder (0700, whatever the umask) beside a secret only its owner can read:
    nobody but this user (and root) can connect, and the core acts only on clients that present the secret."""
    # ipc:// paths are limited to ~107 bytes: keep them in the system temp folder, not under data_dir.
    folder = Path(tempfile.mkdtemp(prefix="loraplex-core-"))  # mkdtemp: mode 0700
    os.chmod(folder, 0o700)
    secret_path = folder / SECRET_NAME
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return f"ipc://{folder}/core.sock"


def core_secret(address: str) -> str:
    """The secret of the core at `address` (a folder made by `new_core_address`); "" for any other address."""
    if not address.startswith("ipc://"):
        return ""
    try:
        return (Path(address.removeprefix("ipc://")).parent / SECRET_NAME).read_text().strip()
    except FileNotFoundError:
        return ""


def remove_core_address(address: str) -> None:
    """The core's private folder goes with it."""
    path = Path(address.removeprefix("ipc://"))
    if (path.parent / SECRET_NAME).exists():
        shutil.rmtree(path.parent, ignore_errors=True)


def run_engine_core(settings: Settings, address: str) -> None:
    """The engine-core process's main: everything that touches the model lives here."""
    die_with_parent(CORE_STOP_SIGNAL)
    # Ctrl-C and a SIGTERM to the process group reach the core too: it keeps stepping while the API servers drain,
    # and the supervisor stops it (CORE_STOP_SIGNAL) once they are done.
    ignore_ctrl_c()
    signal.signal(signal.SIGTERM, _drain_notice)
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.core.engine_core import EngineCore
    from loraplex.engine.core.zmq_core_transport import ZmqCoreTransport
    from loraplex.grammar.compiler import GrammarCompilerService, GrammarLimits
    from loraplex.platform.db.session import make_db_engine, make_session_factory
    from loraplex.platform.grammar_wire import SpecGrammarCodec
    from loraplex.platform.request_context import configure_logging
    from loraplex.platform.routers.adapters import adapter_limits, stored_adapter_source
    from loraplex.platform.startup_heap import freeze_startup_heap
    from loraplex.platform.wiring import engine_config, served_model_name

    configure_logging(settings.log_level)
    threads = settings.resolve_engine_cpu_threads()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    signal.signal(CORE_STOP_SIGNAL, _exit)
    db_engine = make_db_engine(settings.resolved_database_url)
    model_path = settings.resolve_model_path()
    source = stored_adapter_source(settings, db_sessions=make_session_factory(db_engine),
                                   model_config=ModelConfig.from_pretrained(model_path),
                                   base_model_name=served_model_name(settings))
    engine = _build_engine(settings, model_path, engine_config(settings), adapters=source,
                           adapter_limits=adapter_limits(settings), detokenize=False)  # the API servers make the text
    # Every decode and mixed-step graph now, not each shape's first step in the middle of serving (CUDA only).
    for name in ("capture_decode_graphs", "capture_mixed_graphs", "capture_default_target_graphs"):
        capture = getattr(engine.runner, name, None)
        if capture is not None:
            capture()
    limits = GrammarLimits(compile_timeout_s=settings.grammar_compile_timeout_s,
                           max_spec_bytes=settings.grammar_max_spec_bytes,
                           max_compiled_bytes=settings.grammar_max_compiled_bytes, backend=settings.grammar_backend,
                           cache_dir=settings.grammar_cache_dir,
                           max_completion_tokens=settings.grammar_max_completion_tokens)
    compiler = GrammarCompilerService(engine.tokenizer, engine.model_config.vocab_size, limits)
    kv_events = start_kv_events(settings, engine.block_manager, source.registry.find)
    if settings.freeze_startup_heap:
        freeze_startup_heap("engine core")
    try:
        EngineCore(engine, ZmqCoreTransport(address, secret=core_secret(address)),
                   grammar_codec=SpecGrammarCodec(compiler),
                   compiles_per_tenant=settings.grammar_compiles_per_tenant).run()
    finally:
        if kv_events is not None:
            kv_events.close()
        engine.close()
        compiler.close()
        db_engine.dispose()


def start_kv_events(settings: Settings, block_manager: Any, find_adapter: Callable[[str], Any]) -> Any:
    """With `kv_events_endpoint` set, publish the block manager's KV-cache events there (engine/kv/events.py)."""
    if settings.kv_events_endpoint is None:
        return None
    from loraplex.engine.kv.events import ZmqKVEventPublisher, topic_for
    from loraplex.platform.metrics_vllm import AdapterNames
    from loraplex.platform.wiring import served_model_name

    topic = topic_for(settings.kv_events_pod or socket.gethostname(), served_model_name(settings))
    publisher = ZmqKVEventPublisher(settings.kv_events_endpoint, topic, block_size=settings.kv_block_size,
                                    lora_name=AdapterNames(find_adapter))
    block_manager.listener = publisher
    log.info("publishing KV-cache events on %s, topic %s", settings.kv_events_endpoint, topic)
    return publisher


def _build_engine(settings: Settings, model_path: Any, config: Any, **kwargs: Any) -> Any:
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.llm_engine import LLMEngine

    if not settings.random_weights:
        return LLMEngine.from_model_path(model_path, config, **kwargs)
    from transformers import AutoTokenizer

    return LLMEngine.from_random(ModelConfig.from_pretrained(model_path), config,
                                 AutoTokenizer.from_pretrained(model_path), **kwargs)


def _exit(_signum: int, _frame: object) -> None:
    raise SystemExit(0)  # unwinds through EngineCore.run's finally: the socket is closed


def _drain_notice(_signum: int, _frame: object) -> None:
    log.info("SIGTERM: serving until the API servers have drained; the supervisor stops the engine core after them")


@dataclass
class EngineCoreProcess:
    process: BaseProcess
    address: str

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.is_alive()  # also reaps it once it has exited

    def wait_ready(self, timeout_s: float, cancelled: Callable[[], bool] = lambda: False) -> bool:
        """True once the core answers; False if `cancelled()` turns true first (checked every 100 ms);
        EngineDeadError if the core exits first or takes longer than `timeout_s`."""
        try:
            handshake(self.address, timeout_s, still_starting=lambda: self.is_alive() and not cancelled(),
                      secret=core_secret(self.address))
        except EngineDeadError:
            if cancelled():
                return False
            if self.is_alive():
                raise
            raise EngineDeadError(f"the engine core exited while starting (exit code {self.process.exitcode})") from None
        return True

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """CORE_STOP_SIGNAL, then SIGKILL after `timeout_s`; the exit code."""
        if self.process.is_alive() and self.process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, CORE_STOP_SIGNAL)
            self.process.join(timeout_s)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
        remove_core_address(self.address)
        return self.process.exitcode


def start_engine_core(settings: Settings) -> EngineCoreProcess:
    address = new_core_address()
    context = multiprocessing.get_context("spawn")  # never fork a process holding threads and a model
    process = context.Process(target=run_engine_core, args=(settings, address), name="loraplex-engine-core")
    process.start()
    log.info("engine core starting (pid %d) on %s", process.pid, address)
    return EngineCoreProcess(process, address)


def connect_engine(settings: Settings, address: str) -> MultiProcessEngineClient:
    """An API server's client of the core at `address` (call on the event loop that will serve requests)."""
    from loraplex.engine.config import ModelConfig
    from loraplex.platform.grammar_wire import SpecGrammarCodec
    from transformers import AutoTokenizer

    model_path = settings.resolve_model_path()
    # The tokenizer loads while the core may still be loading the model (they start together).
    tokenizer, model_config = AutoTokenizer.from_pretrained(model_path), ModelConfig.from_pretrained(model_path)
    secret = core_secret(address)
    ready = handshake(address, timeout_s=settings.engine_core_start_timeout_s, secret=secret)
    return MultiProcessEngineClient(address, tokenizer=tokenizer, model_config=model_config, ready=ready, secret=secret,
                                    grammar_codec=SpecGrammarCodec())
