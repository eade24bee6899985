"""Content-addressed blob storage for adapter files.

Blobs are named by the sha256 of their bytes, so identical uploads are stored
once and a record only needs the digest. `BlobStore` is the small interface an
object store (S3, GCS) could implement later; `LocalBlobStore` keeps blobs
under the data directory as `blobs/ab/abcdef...`, written to a temporary file
and renamed into place so a reader never sees half a blob.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Protocol

_CHUNK = 1 << 20


class BlobStore(Protocol):
    def put_file(self, path: Path, *, sha256: str | None = None) -> str:
        """Store a file's bytes; return their sha256 (hex; `sha256`: already computed by the caller). Storing the
        same bytes twice keeps one blob and makes it new again (the storage sweep leaves young blobs alone)."""

    def holding(self, digests: Iterable[str]) -> AbstractContextManager[None]:
        """While held, no other holder (any process sharing the store) stores-and-references or checks-and-
        removes these blobs: an upload's store-then-create-record and a deletion's no-reference-left-then-remove
        are each one step, so neither removes a blob the other has just referenced."""

    def exists(self, sha256: str) -> bool: ...

    def local_path(self, sha256: str) -> Path:
        """A local file holding the blob (an object store would fill a local cache). KeyError if absent."""

    def delete(self, sha256: str) -> bool:
        """Remove the blob; False if it was not there."""


def link_adapter_files(store: BlobStore, folder: Path, *, config_sha256: str, weights_sha256: str) -> None:
    """Lay an adapter out as the PEFT folder readers expect: links to its blobs, not copies of them.

    A link holds its target as written and resolves it against the link's own folder, so a relative blob
    path (a relative data directory) would dangle; targets are made absolute here, whatever the store gave.
    """
    from loraplex.adapters.peft_format import CONFIG_NAME, WEIGHTS_NAME

    for name, sha256 in ((CONFIG_NAME, config_sha256), (WEIGHTS_NAME, weights_sha256)):
        (folder / name).symlink_to(store.local_path(sha256).absolute())


def drop_unreferenced_blobs(store: BlobStore, digests: set[str], num_refs: Callable[[str], int]) -> None:
    """Remove the blobs no record that may be served points at, each checked and removed under its lock (an
    identical upload storing it again at this moment, for any tenant, keeps it)."""
    with store.holding(digests):
        for sha in digests:
            if num_refs(sha) == 0:
                store.delete(sha)


def sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class LocalBlobStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root).absolute()
        self._blobs = self.root / "blobs"
        self._staging = self.root / "staging"
        self._locks = self.root / "locks"
        self._blobs.mkdir(parents=True, exist_ok=True)
        self._staging.mkdir(parents=True, exist_ok=True)

    def _path(self, sha256: str) -> Path:
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise KeyError(sha256)
        return self._blobs / sha256[:2] / sha256

    def put_file(self, path: Path, *, sha256: str | None = None) -> str:
        sha256 = sha256 or sha256_of_file(path)
        target = self._path(sha256)
        if target.is_file():
            try:
                os.utime(target)  # referenced again: as young as a new blob to the sweep
                return sha256
            except FileNotFoundError:
                pass  # removed this very moment: store it again
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=self._staging)
        os.close(fd)
        try:
            shutil.copyfile(path, tmp_name)
            os.replace(tmp_name, target)
        finally:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)
        return sha256

    @contextmanager
    def holding(self, digests: Iterable[str]) -> Iterator[None]:
        """An exclusive flock per digest shard (in a fixed order: two holders never wait on each other)."""
        self._locks.mkdir(parents=True, exist_ok=True)
        files = []
        try:
            for shard in sorted({self._path(d).parent.name for d in digests}):
                lock = (self._locks / shard).open("a+b")
                files.append(lock)
                fcntl.flock(lock, fcntl.LOCK_EX)
            yield
        finally:
            for lock in reversed(files):
                lock.close()  # closing the file releases its flock

    def exists(self, sha256: str) -> bool:
        try:
            return self._path(sha256).is_file()
        except KeyError:
            return False

    def local_path(self, sha256: str) -> Path:
        path = self._path(sha256)
        if not path.is_file():
            raise KeyError(sha256)
        return path

    def delete(self, sha256: str) -> bool:
        try:
            self._path(sha256).unlink()
        except (FileNotFoundError, KeyError):
            return False
        return True

    def count(self) -> int:
        return sum(1 for p in self._blobs.glob("*/*") if p.is_file())

    def age_of(self, sha256: str, now: float) -> float | None:
        try:
            return now - self._path(sha256).stat().st_mtime
        except (FileNotFoundError, KeyError):
            return None

    def blob_ages(self, now: float) -> dict[str, float]:
        """Every stored blob's digest -> seconds since it was written (for the storage sweep)."""
        ages = {}
        for path in self._blobs.glob("*/*"):
            try:
                ages[path.name] = now - path.stat().st_mtime
            except FileNotFoundError:
                continue
        return ages
