"""Hostile archives small on the wire and huge in metadata, written without ever holding them in memory.

Also runnable as a script (`python archive_bombs.py KIND PATH DEST`): extracts PATH into DEST with the
default limits in a fresh process and prints `{"error": ..., "seconds": ..., "peak_bytes": ...}`, so a
test can measure the memory one refusal costs, free of everything else the test process holds.
"""

from __future__ import annotations

import gzip
import io
import json
import struct
import sys
import tarfile
import time
import tracemalloc
import zipfile
from pathlib import Path

_ZEROS = b"\0" * (1 << 20)


def _tar_header(name: str, size: int, kind: bytes) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(format=tarfile.GNU_FORMAT)


def _write_payload(gz: gzip.GzipFile, size: int) -> None:
    left = size
    while left:
        n = min(left, len(_ZEROS))
        gz.write(_ZEROS[:n])
        left -= n
    gz.write(b"\0" * (-size % 512))


def tar_extension_bomb(path: Path, kind: bytes, size: int = 200 * 1024 * 1024) -> Path:
    """One GNU long-name ('L') or PAX ('x') header declaring `size` bytes of payload, then a member."""
    with gzip.open(path, "wb", compresslevel=9) as gz:
        gz.write(_tar_header("././@LongLink" if kind != tarfile.XHDTYPE else "pax", size, kind))
        _write_payload(gz, size)
        gz.write(_tar_header("adapter_config.json", 2, tarfile.REGTYPE) + b"{}" + b"\0" * 510)
        gz.write(b"\0" * 1024)
    return path


def tar_header_chain(path: Path, count: int = 20_000) -> Path:
    """Thousands of small long-name headers in a row: the standard library follows them recursively."""
    with gzip.open(path, "wb") as gz:
        for _ in range(count):
            gz.write(_tar_header("././@LongLink", 100, tarfile.GNUTYPE_LONGNAME) + b"a" * 100 + b"\0" * 412)
        gz.write(_tar_header("adapter_config.json", 2, tarfile.REGTYPE) + b"{}" + b"\0" * 510)
        gz.write(b"\0" * 1024)
    return path


def tar_skipped_bomb(path: Path, size: int = 3 * 1024 * 1024 * 1024) -> Path:
    """A member we would skip, gigabytes of zeros: skipping still means decompressing them."""
    with gzip.open(path, "wb", compresslevel=1) as gz:
        gz.write(_tar_header("junk.dat", size, tarfile.REGTYPE))
        _write_payload(gz, min(size, 64 * 1024 * 1024))  # the rest is never reached: refused first
    return path


def zip_many_entries(path: Path, count: int = 100_000) -> Path:
    """A central directory of 100,000 entries: `ZipFile` would build an object for every one."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for i in range(count):
            zf.writestr(f"{i}", b"")
    return path


def zip_lying_directory(path: Path) -> Path:
    """A tiny zip whose end record claims a 1 GB central directory of 3 entries."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("adapter_config.json", b"{}")
    data = bytearray(buf.getvalue())
    end = data.rfind(b"PK\x05\x06")
    struct.pack_into("<I", data, end + 12, 1 << 30)  # size of the central directory
    path.write_bytes(bytes(data))
    return path


def zip_nested(path: Path) -> Path:
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as zf:
        zf.writestr("adapter_config.json", b"{}")
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("inner.zip", inner.getvalue())
    return path


def tar_nested(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        data = b"\x1f\x8b" + b"\0" * 30
        info = tarfile.TarInfo("weights/inner.tar.gz")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    return path


def corrupt_gzip(path: Path) -> Path:
    path.write_bytes(b"\x1f\x8b\x08\x00" + b"\xff" * 200)
    return path


def corrupt_zip(path: Path) -> Path:
    end_record = b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, 1, 1, 46, 1_000_000, 0)  # directory past the end
    path.write_bytes(b"PK\x03\x04" + b"\x00" * 60 + end_record)
    return path


def measure_extraction(archive: Path, dest: Path) -> dict:
    from loraplex.adapters.archive import UploadLimits, extract_adapter_archive

    tracemalloc.start()
    start = time.perf_counter()
    error = None
    try:
        extract_adapter_archive(archive, dest, UploadLimits())
    except Exception as exc:  # reported to the parent test, which asserts on it
        error = f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    return {"error": error, "seconds": seconds, "peak_bytes": peak}


if __name__ == "__main__":
    print(json.dumps(measure_extraction(Path(sys.argv[1]), Path(sys.argv[2]))))
