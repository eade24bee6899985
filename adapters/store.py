"""Content-addressed blob storage for adapter files.

Blobs are named by the sha256 of their bytes, so identical uploads are stored
once and a record only needs the digest. `BlobStore` is the small interface an
object store (S3, GCS) could implement later; `LocalBlobStore` keeps blobs
under the data directory as `blobs/ab/abcdef...`, written to a temporary file
and renamed into place so a reader never sees half a blob.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Protocol

_CHUNK = 1 << 20


class BlobStore(Protocol):
    def put_file(self, path: Path) -> str:
        """Store a file's bytes; return their sha256 (hex). Storing the same bytes twice is a no-op."""

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
        self._blobs.mkdir(parents=True, exist_ok=True)
        self._staging.mkdir(parents=True, exist_ok=True)

    def _path(self, sha256: str) -> Path:
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise KeyError(sha256)
        return self._blobs / sha256[:2] / sha256

    def put_file(self, path: Path) -> str:
        sha256 = sha256_of_file(path)
        target = self._path(sha256)
        if target.is_file():
            return sha256
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

    def blob_ages(self, now: float) -> dict[str, float]:
        """Every stored blob's digest -> seconds since it was written (for the storage sweep)."""
        ages = {}
        for path in self._blobs.glob("*/*"):
            try:
                ages[path.name] = now - path.stat().st_mtime
            except FileNotFoundError:
                continue
        return ages
