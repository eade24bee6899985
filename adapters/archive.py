"""Safe extraction of an uploaded .zip / .tar.gz holding a PEFT adapter.

Refused: absolute paths, `..` components, links (symbolic or hard), devices,
more members than allowed, more expanded bytes than allowed (counted while
decompressing, never trusting sizes the archive declares), pickled weights,
archives inside the archive. Only the two files we serve are written out,
flat, into the destination.

Metadata is bounded before it is read, because the standard library reads it
whole: a zip's central directory size and entry count come from its end
record and are checked before the directory is parsed; a tar's long-name and
PAX extended headers are checked by their declared size before their payload
is read, and every header (member or extension) counts toward the member
limit. Skipped tar members count their size toward the expanded total, since
skipping them still means decompressing them.
"""

from __future__ import annotations

import stat
import tarfile
import zipfile
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from struct import error as struct_error
from typing import IO, Any

from loraplex.adapters.errors import UnsafeUploadError, UnsupportedMediaError, UploadTooLargeError
from loraplex.adapters.peft_format import CONFIG_NAME, PICKLE_SUFFIXES, WEIGHTS_NAME

_WANTED = (CONFIG_NAME, WEIGHTS_NAME)
_CHUNK = 1 << 20
_NESTED_ARCHIVE_SUFFIXES = (".zip", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".zst", ".7z", ".rar")
_MAX_NAME_BYTES = 1024            # one member's path
_MAX_EXTENDED_HEADER_BYTES = 64 * 1024  # one tar long-name or PAX header's payload
_CENTRAL_DIRECTORY_BYTES_PER_MEMBER = 46 + _MAX_NAME_BYTES + 1024  # fixed part + name + extra/comment
# Called for every tar header read (members and extension headers alike), set while one archive is read.
_ON_TAR_HEADER: ContextVar[Callable[[], None] | None] = ContextVar("on_tar_header", default=None)


@dataclass(frozen=True, slots=True)
class UploadLimits:
    max_upload_bytes: int = 512 * 1024 * 1024     # one uploaded file (or archive), compressed
    max_expanded_bytes: int = 1024 * 1024 * 1024  # all members of an archive, decompressed
    max_archive_members: int = 64
    max_config_bytes: int = 1024 * 1024

    @classmethod
    def from_settings(cls, settings: Any) -> UploadLimits:
        return cls(max_upload_bytes=settings.adapter_max_upload_bytes,
                   max_expanded_bytes=settings.adapter_max_expanded_bytes,
                   max_archive_members=settings.adapter_max_archive_members,
                   max_config_bytes=settings.adapter_max_config_bytes)


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
    if len(name.encode("utf-8", "surrogateescape")) > _MAX_NAME_BYTES:
        raise UnsafeUploadError(f"an archive member's name is longer than {_MAX_NAME_BYTES} bytes")
    if "\\" in name or name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise UnsafeUploadError(f"archive member {name!r} has an absolute path")
    parts = PurePosixPath(name).parts
    if ".." in parts:
        raise UnsafeUploadError(f"archive member {name!r} escapes the archive (path traversal)")
    base = parts[-1] if parts else ""
    if base.endswith(PICKLE_SUFFIXES):
        raise UnsafeUploadError(f"archive member {name!r}: pickled weights are refused; use safetensors")
    if base.lower().endswith(_NESTED_ARCHIVE_SUFFIXES):
        raise UnsafeUploadError(f"archive member {name!r} is an archive itself; nested archives are refused")
    return base if base in _WANTED else None


def _copy(src: IO[bytes], target: Path, budget: _Budget) -> None:
    if target.exists():
        raise UnsafeUploadError(f"the archive holds more than one {target.name}")
    with target.open("wb") as out:
        while chunk := src.read(_CHUNK):
            budget.count_bytes(len(chunk))
            out.write(chunk)


def _check_zip_directory(archive: Path, budget: _Budget) -> None:
    """Refuse a central directory too large for the member limit before `ZipFile` reads and parses it."""
    limit = budget.limits.max_archive_members
    with archive.open("rb") as f:
        try:
            # the end record (zip64 aware), as ZipFile itself reads it: CPython internals typeshed leaves out
            end_record = zipfile._EndRecData(f)  # type: ignore[attr-defined]
        except (OSError, ValueError, struct_error) as exc:
            raise UnsafeUploadError(f"the zip archive is corrupt: {exc}") from None
    if end_record is None:
        raise UnsafeUploadError("the zip archive is corrupt: no end of central directory record")
    num_entries = end_record[zipfile._ECD_ENTRIES_TOTAL]  # type: ignore[attr-defined]  # (as above)
    directory_bytes = end_record[zipfile._ECD_SIZE]  # type: ignore[attr-defined]
    if num_entries > limit:
        raise UnsafeUploadError(f"the archive has more than {limit} members")
    if directory_bytes > limit * _CENTRAL_DIRECTORY_BYTES_PER_MEMBER:
        raise UnsafeUploadError(f"the zip's central directory ({directory_bytes} bytes) is too large for "
                                f"{limit} members")


def _extract_zip(archive: Path, dest: Path, budget: _Budget) -> None:
    _check_zip_directory(archive, budget)
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError, ValueError, struct_error) as exc:
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


class _BoundedTarInfo(tarfile.TarInfo):
    """A TarInfo that checks extension headers before the standard library reads their payload.

    `tarfile` reads a GNU long name or a PAX header whole into memory, and follows
    a chain of them recursively, before the member it describes is returned; a
    few hundred KB of gzip can declare hundreds of MB of them.
    """

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        on_header = _ON_TAR_HEADER.get()
        if on_header is not None:
            on_header()
        if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
                         tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE):
            if self.size > _MAX_EXTENDED_HEADER_BYTES:
                raise UnsafeUploadError(
                    f"a tar extended header declares {self.size} bytes (at most {_MAX_EXTENDED_HEADER_BYTES})"
                )
        elif self.type == tarfile.GNUTYPE_SPARSE:
            raise UnsafeUploadError("sparse tar members are refused")
        return super()._proc_member(tarfile_)  # type: ignore[misc]  # TarInfo internals typeshed leaves out


def _extract_tar(archive: Path, dest: Path, budget: _Budget) -> None:
    token = _ON_TAR_HEADER.set(budget.count_member)
    try:
        _read_tar(archive, dest, budget)
    finally:
        _ON_TAR_HEADER.reset(token)


def _read_tar(archive: Path, dest: Path, budget: _Budget) -> None:
    try:
        tf = tarfile.open(archive, mode="r:gz", tarinfo=_BoundedTarInfo)  # noqa: SIM115 - closed by `with tf`
    except (tarfile.TarError, OSError, EOFError, ValueError, RecursionError) as exc:
        raise UnsafeUploadError(f"the tar.gz archive is corrupt: {exc}") from None
    with tf:
        try:
            for member in tf:
                if member.issym() or member.islnk():
                    raise UnsafeUploadError(f"archive member {member.name!r} is a link")
                if not (member.isfile() or member.isdir()):
                    raise UnsafeUploadError(f"archive member {member.name!r} is not a regular file")
                keep = _check_name(member.name)
                if member.isdir() or keep is None:
                    budget.count_bytes(member.size)  # skipping it still decompresses it
                    continue
                src = tf.extractfile(member)
                if src is None:
                    raise UnsafeUploadError(f"archive member {member.name!r} cannot be read")
                _copy(src, dest / keep, budget)
        except (tarfile.TarError, EOFError, OSError, ValueError, RecursionError) as exc:
            raise UnsafeUploadError(f"the tar.gz archive is corrupt: {exc}") from None
