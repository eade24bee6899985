"""The host-memory tier: an LRU of adapters' weights, filled off the engine thread.

`request(id)` starts a background load from the `AdapterSource` (disk, blob
store) and returns at once; the engine thread polls `get(id)`. A failed load
is kept as an error the engine can report to the waiting requests.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from loraplex.engine.interfaces import AdapterSource, AdapterWeights

logger = logging.getLogger(__name__)


class HostAdapterCache:
    def __init__(self, source: AdapterSource, *, max_cpu_loras: int, num_loader_threads: int = 4) -> None:
        self.source = source
        self.max_cpu_loras = max(1, max_cpu_loras)
        self._weights: OrderedDict[str, AdapterWeights] = OrderedDict()
        self._loading: set[str] = set()
        self._errors: dict[str, str] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=num_loader_threads, thread_name_prefix="lora-load")
        self.num_loads = 0

    def get(self, adapter_id: str) -> AdapterWeights | None:
        with self._lock:
            weights = self._weights.get(adapter_id)
            if weights is not None:
                self._weights.move_to_end(adapter_id)
            return weights

    def request(self, adapter_id: str) -> None:
        with self._lock:
            if adapter_id in self._weights or adapter_id in self._loading or adapter_id in self._errors:
                return
            self._loading.add(adapter_id)
        self._pool.submit(self._load, adapter_id)

    def is_loading(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self._loading

    def error(self, adapter_id: str) -> str | None:
        with self._lock:
            return self._errors.get(adapter_id)

    def fail(self, adapter_id: str, reason: str) -> None:
        """Drop the host copy and remember why the adapter cannot be served."""
        with self._lock:
            self._weights.pop(adapter_id, None)
            self._errors[adapter_id] = reason

    def drop(self, adapter_id: str) -> None:
        with self._lock:
            self._weights.pop(adapter_id, None)
            self._errors.pop(adapter_id, None)

    def __contains__(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self._weights

    def __len__(self) -> int:
        with self._lock:
            return len(self._weights)

    def _load(self, adapter_id: str) -> None:
        try:
            weights = self.source.load(adapter_id)
        except Exception as exc:
            logger.warning("loading adapter %s failed: %s", adapter_id, exc)
            with self._lock:
                self._loading.discard(adapter_id)
                self._errors[adapter_id] = f"adapter {adapter_id} could not be loaded: {exc}"
            return
        with self._lock:
            self._loading.discard(adapter_id)
            self._weights[adapter_id] = weights
            self.num_loads += 1
            while len(self._weights) > self.max_cpu_loras:
                self._weights.popitem(last=False)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
