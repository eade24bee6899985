"""The host-memory tier: an LRU of adapters' weights, filled off the engine thread.

`request(id)` starts a background load from the `AdapterSource` (disk, blob
store) and returns at once; the engine thread polls `get(id)`. A failed load
becomes an error the engine fails the waiting requests with, kept only while
it is likely to still be true:

  - permanent: the files are not a servable adapter for this model (rejected
    format, shapes or ranks that do not fit). Kept until the adapter is
    dropped or its files move.
  - transient: anything else (OSError, out of memory, a timeout, an id not
    ready yet). Kept for a backoff that doubles with each consecutive failure
    of that adapter (a successful load resets it); the first request after it
    starts a fresh load.

Either kind ends at once when the source says the files moved (a re-upload:
new path or content hash; see `LocatingAdapterSource`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.interfaces import AdapterSource, AdapterWeights
from loraplex.engine.lora.slot_pool import AdapterShapeError

logger = logging.getLogger(__name__)

# Failures that reading the same files again would repeat: the adapters domain's rejections of a file's
# content are InvalidRequestErrors, the slot pool's misfits AdapterShapeErrors. Everything else may pass.
PERMANENT_LOAD_ERRORS: tuple[type[Exception], ...] = (AdapterShapeError, InvalidRequestError)


@runtime_checkable
class LocatingAdapterSource(Protocol):
    """An `AdapterSource` that can tell where an adapter's files are now (a path or content hash).

    Optional: with it, a permanent failure holds only while the files stay where they failed, so a
    re-upload is loaded at once. It is called on the engine thread, so it must not block (no I/O).
    """

    def locate(self, adapter_id: str) -> str | None: ...


@dataclass(frozen=True, slots=True)
class LoadFailure:
    reason: str
    is_permanent: bool
    location: str | None  # where the files were; the failure holds only while they stay there
    num_consecutive: int  # failures of these files since the adapter last loaded
    backoff_s: float  # transient: how long requests fail before one retries
    retry_at: float  # time.monotonic() from which a request starts a fresh load (inf when permanent)


class HostAdapterCache:
    def __init__(
        self,
        source: AdapterSource,
        *,
        max_cpu_loras: int,
        num_loader_threads: int = 4,
        retry_base_s: float = 1.0,
        retry_max_s: float = 60.0,
    ) -> None:
        self.source = source
        self._locator = source if isinstance(source, LocatingAdapterSource) else None  # checked once: not cheap
        self.max_cpu_loras = max(1, max_cpu_loras)
        self.retry_base_s = retry_base_s
        self.retry_max_s = retry_max_s
        self._weights: OrderedDict[str, AdapterWeights] = OrderedDict()
        self._locations: dict[str, str | None] = {}  # where each host copy was read from
        self._loading: set[str] = set()
        self._failures: dict[str, LoadFailure] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=num_loader_threads, thread_name_prefix="lora-load")
        self.num_loads = 0
        self.num_load_attempts: Counter[str] = Counter()  # reads of each adapter's files started

    def get(self, adapter_id: str) -> AdapterWeights | None:
        with self._lock:
            weights = self._weights.get(adapter_id)
            if weights is not None:
                self._weights.move_to_end(adapter_id)
            return weights

    def request(self, adapter_id: str) -> None:
        """Start loading unless it is here, loading, or failed in a way that still holds."""
        location = self._locate(adapter_id)
        with self._lock:
            if adapter_id in self._weights or adapter_id in self._loading:
                return
            failure = self._failures.get(adapter_id)
            if failure is not None and _holds(failure, location):
                return
            self._loading.add(adapter_id)
            self.num_load_attempts[adapter_id] += 1
        self._pool.submit(self._load, adapter_id, location)

    def is_loading(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self._loading

    def error(self, adapter_id: str) -> str | None:
        """Why the adapter cannot be served now; None while it loads or once a retry is due."""
        with self._lock:
            failure = self._failures.get(adapter_id)
            if failure is None or adapter_id in self._loading:
                return None
        return failure.reason if _holds(failure, self._locate(adapter_id)) else None

    def failure(self, adapter_id: str) -> LoadFailure | None:
        """The adapter's last load failure, while no load has succeeded since."""
        with self._lock:
            return self._failures.get(adapter_id)

    def fail(self, adapter_id: str, exc: Exception) -> None:
        """Drop a host copy that cannot be served (`exc` says why) and keep the failure as a load's would be."""
        with self._lock:
            self._weights.pop(adapter_id, None)
            location = self._locations.pop(adapter_id, None)
        self._record_failure(adapter_id, exc, location)

    def drop(self, adapter_id: str) -> None:
        with self._lock:
            self._weights.pop(adapter_id, None)
            self._locations.pop(adapter_id, None)
            self._failures.pop(adapter_id, None)

    def __contains__(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self._weights

    def __len__(self) -> int:
        with self._lock:
            return len(self._weights)

    def _locate(self, adapter_id: str) -> str | None:
        return None if self._locator is None else self._locator.locate(adapter_id)

    def _load(self, adapter_id: str, location: str | None) -> None:
        try:
            weights = self.source.load(adapter_id)
        except Exception as exc:  # MemoryError included: a failed load must never kill the loader
            self._record_failure(adapter_id, exc, location)
            return
        with self._lock:
            self._loading.discard(adapter_id)
            self._failures.pop(adapter_id, None)
            self._weights[adapter_id] = weights
            self._locations[adapter_id] = location
            self.num_loads += 1
            while len(self._weights) > self.max_cpu_loras:
                evicted, _ = self._weights.popitem(last=False)
                self._locations.pop(evicted, None)

    def _record_failure(self, adapter_id: str, exc: Exception, location: str | None) -> None:
        is_permanent = isinstance(exc, PERMANENT_LOAD_ERRORS)
        with self._lock:
            self._loading.discard(adapter_id)
            previous = self._failures.get(adapter_id)
            same_files = previous if previous is not None and previous.location == location else None
            num_consecutive = 1 if same_files is None else same_files.num_consecutive + 1
            if is_permanent:
                backoff_s, retry_at = 0.0, math.inf
                reason = f"adapter {adapter_id} cannot be served: {exc}"
            else:
                backoff_s = min(self.retry_max_s, self.retry_base_s * 2.0 ** min(num_consecutive - 1, 32))
                retry_at = time.monotonic() + backoff_s
                reason = (f"adapter {adapter_id} could not be loaded ({type(exc).__name__}: {exc}); "
                          f"a request after {backoff_s:g}s will try again")
            self._failures[adapter_id] = LoadFailure(reason, is_permanent, location, num_consecutive, backoff_s,
                                                     retry_at)
        logger.warning("%s (failure %d in a row)", reason, num_consecutive)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _holds(failure: LoadFailure, location: str | None) -> bool:
    """Would loading again now fail the same way? `location` is where the files are now."""
    if failure.location != location:
        return False  # re-uploaded or moved: other files, worth a load at once
    return failure.is_permanent or time.monotonic() < failure.retry_at
