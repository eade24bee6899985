"""CPU paged decode attention (the C++ extension `cpu_paged_decode.cpp`), built on first use.

The extension is compiled at runtime on the machine that runs it (so `-march=native` is safe) into
`$LORAPLEX_CACHE_DIR` or `~/.cache/loraplex/torch_extensions/<name>`, where the name carries a
hash of the source, the torch version and the Python version: an edited kernel or a new torch
builds afresh, a warm cache only loads. Builds are serialised by a thread lock and an `flock` on
the cache folder (the OS drops an flock when its process dies, unlike torch's own lock file,
which a killed build leaves behind: under our flock any such file is stale and is removed).

Any failure to build or load (no compiler, no ninja, a compile error) logs one warning and makes
`paged_decode_kernel()` return None: the caller keeps the PyTorch gather + SDPA path.
Set `LORAPLEX_CPU_PAGED_DECODE=0` to skip the kernel altogether.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from loraplex.engine.host_info import cpu_model_name

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_decode.cpp")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CFLAGS = ["-O3", "-march=native", "-fopenmp"]  # -fopenmp: at::parallel_for's OpenMP body, and `omp simd`

_lock = threading.Lock()
_module: Any = None
_tried = False


def enabled() -> bool:
    return os.environ.get("LORAPLEX_CPU_PAGED_DECODE", "1") not in ("0", "false", "no", "off")


def paged_decode_kernel() -> Any:
    """The loaded kernel's operators (`torch.ops.loraplex_cpu`: its `paged_decode`), or None when it is disabled
    or cannot build."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if not _tried:
            _module = _build() if enabled() else None
            _tried = True
    return _module


def extension_name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(sys.version.encode())
    digest.update(cpu_model_name().encode())  # -march=native: a home folder shared by other CPUs gets its own build
    return f"loraplex_cpu_paged_decode_{digest.hexdigest()[:16]}"


def build_root() -> Path:
    root = os.environ.get("LORAPLEX_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "loraplex"
    return base / "torch_extensions"


def _build() -> Any:
    try:
        return _load()
    except Exception as exc:  # a missing compiler or ninja, a compile error: keep the PyTorch path
        logger.warning("CPU paged decode kernel unavailable, using gather + SDPA: %s", exc)
        return None


def _load() -> Any:
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    name = extension_name()
    build_dir = build_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(build_dir.parent / f"{name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # one builder per cache folder across processes
        try:
            stale = build_dir / "lock"  # torch's FileBaton; nobody else is inside while we hold the flock
            if stale.exists():
                stale.unlink()
            # Built from a copy inside the build folder: ninja's build file names its sources by path, so two
            # checkouts (a clean clone beside a working tree) building from their own paths rebuilt the
            # shared folder in turn, a minute or two each. The name already carries the source's hash.
            source = build_dir / SOURCE.name
            text = SOURCE.read_bytes()
            if not source.exists() or source.read_bytes() != text:
                source.write_bytes(text)
            cpp_extension.load(  # registers the operator namespace torch.ops.loraplex_cpu
                name=name, sources=[str(source)], build_directory=str(build_dir),
                extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], verbose=False, is_python_module=False,
            )
            module = torch.ops.loraplex_cpu
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
    logger.info("CPU paged decode kernel ready in %.1fs (%s)", time.perf_counter() - started, build_dir)
    return module


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; a venv's python run by full path lacks the venv's bin."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # the `ninja` wheel ships the binary
    except ImportError:
        return  # cpp_extension then raises its own clear error, which becomes the warning
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
