"""Storage that no adapter needs any more is removed: blobs of failed or deleted adapters, abandoned staging.

Deleting an adapter and failing its validation drop its blobs at once; this
sweep catches what those paths can miss (a process killed between storing a
blob and creating its record, a staging folder of a crashed upload, a record
deleted from another process while its blob was being written). Anything
younger than `min_age_s` is left alone, so an upload in progress (its blobs
stored a moment before its record is created) is never swept; storing bytes
that are already there makes their blob young again, and each removal
re-checks, under the blob's lock, that it is still old and unreferenced.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from loraplex.adapters.registry import AdapterRegistry
from loraplex.adapters.store import LocalBlobStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SweepResult:
    num_blobs_removed: int
    num_staging_removed: int


def sweep_storage(registry: AdapterRegistry, store: LocalBlobStore, staging_root: Path, *,
                  min_age_s: float) -> SweepResult:
    now = time.time()
    live = registry.live_blob_digests()
    num_blobs = 0
    for digest, age in store.blob_ages(now).items():
        if age >= min_age_s and digest not in live and _drop_orphan(registry, store, digest, min_age_s):
            num_blobs += 1
    num_staging = 0
    if staging_root.is_dir():
        for entry in staging_root.iterdir():
            if now - _newest_mtime(entry) >= min_age_s:
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                num_staging += 1
    if num_blobs or num_staging:
        log.info("storage sweep removed %d orphaned blobs and %d abandoned staging entries", num_blobs, num_staging)
    return SweepResult(num_blobs, num_staging)


def _drop_orphan(registry: AdapterRegistry, store: LocalBlobStore, digest: str, min_age_s: float) -> bool:
    """Under the blob's lock, still unreferenced and still old (an identical upload storing it again makes it
    new, and references it before letting go of the lock): removed."""
    with store.holding([digest]):
        age = store.age_of(digest, time.time())
        if age is None or age < min_age_s or registry.num_blob_refs(digest):
            return False
        return store.delete(digest)


def _newest_mtime(path: Path) -> float:
    """An upload still writing touches its files, not its folder: the newest time anywhere inside."""
    try:
        newest = path.stat().st_mtime
        if path.is_dir():
            for child in path.rglob("*"):
                newest = max(newest, child.stat().st_mtime)
    except FileNotFoundError:
        return time.time()
    return newest


class StorageSweeper:
    """Runs `sweep_storage` every `interval_s` in a daemon thread until `stop()`."""

    def __init__(self, registry: AdapterRegistry, store: LocalBlobStore, staging_root: Path, *,
                 interval_s: float, min_age_s: float) -> None:
        self._args = (registry, store, staging_root)
        self._interval_s = interval_s
        self._min_age_s = min_age_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adapter-storage-sweep", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            try:
                sweep_storage(*self._args, min_age_s=self._min_age_s)
            except Exception:  # a failed sweep (database down) is retried at the next interval
                log.exception("adapter storage sweep failed")
