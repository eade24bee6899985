"""Safe extraction of an uploaded .zip / .tar.gz holding a PEFT adapter.

Refused: absolute paths, `..` components, links (symbolic or hard), devices,
more members than allowed, more expanded bytes than allowed (counted while
decompressing, never trusting sizes the archive declares), pickled weights.
Only the two files we serve are written out, flat, into the destination.
"""

from __future__ import annotations

import stat
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from loraplex.adapters.errors import UnsafeUploadError, UnsupportedMediaError, UploadTooLargeError
from loraplex.adapters.peft_format import CONFIG_NAME, PICKLE_SUFFIXES, WEIGHTS_NAME

_WANTED = (CONFIG_NAME, WEIGHTS_NAME)
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class UploadLimits:
    max_upload_bytes: int = 512 * 1024 * 1024     # one uploaded file (or archive), compressed
    max_expanded_bytes: int = 1024 * 1024 * 1024  # all members of an archive, decompressed
    max_archive_members: int = 64
    max_config_bytes: int = 1024 * 1024


def archive_kind(path: Path) -> str:
    with path.open("rb") as f:
        magic = f.read(4)
    if magic.startswith(b"PK\x03\x04") or magic.startswith(b"PK\x05\x06"):
        return "zip"
    if magic.startswith(b"\x1f\x8b"):
        return "tar.gz"
    raise UnsupportedMediaError("the archive is neither a .zip nor a .tar.gz")


def extract_adapter_archive(archive: Path, dest: Path, limits: UploadLimits) -> None:
    """Write adapter_config.json and adapter_model.safetensors from the archive into `dest`."""
    kind = archive_kind(archive)
    budget = _Budget(limits)
    if kind == "zip":
        _extract_zip(archive, dest, budget)
    else:
        _extract_tar(archive, dest, budget)
    for name in _WANTED:
        if not (dest / name).is_file():
            raise UnsafeUploadError(f"the archive holds no {name}")


class _Budget:
    def __init__(self, limits: UploadLimits) -> None:
        self.limits = limits
        self.members = 0
        self.expanded = 0

    def count_member(self) -> None:
        self.members += 1
        if self.members > self.limits.max_archive_members:
            raise UnsafeUploadError(f"the archive has more than {self.limits.max_archive_members} members")

    def count_bytes(self, n: int) -> None:
        self.expanded += n
        if self.expanded > self.limits.max_expanded_bytes:
            raise UploadTooLargeError(
                f"the archive expands past {self.limits.max_expanded_bytes} bytes (a decompression bomb?)"
            )


def _check_name(name: str) -> str | None:
    """Return the member's file name if it is one we keep; None to skip it. Raise on hostile names."""
    if "\\" in name or name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise UnsafeUploadError(f"archive member {name!r} has an absolute path")
    parts = PurePosixPath(name).parts
    if ".." in parts:
        raise UnsafeUploadError(f"archive member {name!r} escapes the archive (path traversal)")
    base = parts[-1] if parts else ""
    if base.endswith(PICKLE_SUFFIXES):
        raise UnsafeUploadError(f"archive member {name!r}: pickled weights are refused; use safetensors")
    return base if base in _WANTED else None


def _copy(src: BinaryIO, target: Path, budget: _Budget) -> None:
    if target.exists():
        raise UnsafeUploadError(f"the archive holds more than one {target.name}")
    with target.open("wb") as out:
        while chunk := src.read(_CHUNK):
            budget.count_bytes(len(chunk))
            out.write(chunk)


def _extract_zip(archive: Path, dest: Path, budget: _Budget) -> None:
    try:
        zf = zipfile.ZipFile(archive)
    except zipfile.BadZipFile as exc:
        raise UnsafeUploadError(f"the zip archive is corrupt: {exc}") from None
    with zf:
        for info in zf.infolist():
            budget.count_member()
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                raise UnsafeUploadError(f"archive member {info.filename!r} is a symbolic link")
            keep = _check_name(info.filename)
            if info.is_dir() or keep is None:
                continue
            try:
                with zf.open(info) as src:
                    _copy(src, dest / keep, budget)
            except (zipfile.BadZipFile, EOFError, OSError) as exc:
                raise UnsafeUploadError(f"archive member {info.filename!r} is corrupt: {exc}") from None


def _extract_tar(archive: Path, dest: Path, budget: _Budget) -> None:
    try:
        tf = tarfile.open(archive, mode="r:gz")  # noqa: SIM115 - closed by the `with tf` below
    except (tarfile.TarError, OSError) as exc:
        raise UnsafeUploadError(f"the tar.gz archive is corrupt: {exc}") from None
    with tf:
        try:
            for member in tf:
                budget.count_member()
                if member.issym() or member.islnk():
                    raise UnsafeUploadError(f"archive member {member.name!r} is a link")
                if not (member.isfile() or member.isdir()):
                    raise UnsafeUploadError(f"archive member {member.name!r} is not a regular file")
                keep = _check_name(member.name)
                if member.isdir() or keep is None:
                    continue
                src = tf.extractfile(member)
                if src is None:
                    raise UnsafeUploadError(f"archive member {member.name!r} cannot be read")
                _copy(src, dest / keep, budget)
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise UnsafeUploadError(f"the tar.gz archive is corrupt: {exc}") from None
