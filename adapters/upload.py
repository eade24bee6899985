"""Receive a multipart adapter upload as a stream, straight to a staging folder on disk.

The body is never held in memory: each chunk goes through python-multipart's
push parser into a file, and the upload is refused (413) as soon as one part
or the whole body passes its limit. Form fields (name, description) are
small and capped. Accepted file parts: `adapter_config.json` +
`adapter_model.safetensors`, or one `.zip` / `.tar.gz`, which is then
extracted safely. The caller deletes the staging folder whatever happens.

Writing the parts to disk (a slow disk blocks), unpacking, hashing and
copying take seconds for a large upload: they run in
one small thread pool (`run_upload_work`), never on the event loop, and at
most `UPLOAD_WORKERS` at once per process, so a burst of uploads queues
instead of taking every core from the requests being served.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TypeVar

from loraplex.adapters.archive import UploadLimits, extract_adapter_archive
from loraplex.adapters.errors import UnsafeUploadError, UnsupportedMediaError, UploadTooLargeError
from loraplex.adapters.multipart_form import MAX_FIELD_BYTES, FormParts
from loraplex.adapters.peft_format import CONFIG_NAME, PICKLE_SUFFIXES, WEIGHTS_NAME
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

UPLOAD_WORKERS = 2
T = TypeVar("T")
_UPLOAD_POOL = ThreadPoolExecutor(max_workers=UPLOAD_WORKERS, thread_name_prefix="adapter-upload")
_ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz")
_DIRECT_FILES = (CONFIG_NAME, WEIGHTS_NAME)


@dataclass(slots=True)
class ReceivedUpload:
    fields: dict[str, str] = field(default_factory=dict)
    folder: Path | None = None  # holds adapter_config.json + adapter_model.safetensors once complete


class _PartSink(FormParts):
    """The adapter's files into the staging folder: the two PEFT files, or one archive."""

    def __init__(self, staging: Path, limits: UploadLimits) -> None:
        super().__init__()
        self.staging = staging
        self.limits = limits
        self.files: dict[str, Path] = {}  # kept file name -> path
        self._file_bytes = 0

    def open_file(self, name: str, filename: str) -> BinaryIO:
        if filename.endswith(PICKLE_SUFFIXES):
            raise UnsafeUploadError(f"{filename}: pickled weights are refused; upload adapter_model.safetensors")
        if filename in _DIRECT_FILES:
            kept = filename
        elif filename.endswith(_ARCHIVE_SUFFIXES):
            kept = "archive"
        else:
            raise UnsupportedMediaError(
                f"unexpected file {filename!r}: upload {CONFIG_NAME} and {WEIGHTS_NAME}, or one .zip / .tar.gz"
            )
        if kept in self.files:
            raise UnsafeUploadError(f"more than one {kept} in the upload")
        path = self.staging / ("upload.archive" if kept == "archive" else kept)
        self.files[kept] = path
        self._file_bytes = 0
        return path.open("wb")

    def write_file(self, chunk: bytes) -> None:
        self._file_bytes += len(chunk)
        if self._file_bytes > self.limits.max_upload_bytes:
            raise UploadTooLargeError(f"an uploaded file is larger than {self.limits.max_upload_bytes} bytes")
        super().write_file(chunk)

    def field_too_long(self, name: str | None) -> Exception:
        return UploadTooLargeError(f"form field {name!r} is longer than {MAX_FIELD_BYTES} bytes")


async def receive_adapter_upload(
    chunks: AsyncIterator[bytes], content_type: str, staging: Path, limits: UploadLimits,
    content_length: int | None = None,
) -> ReceivedUpload:
    """Parse the body into `staging`; return the form fields and the folder holding the two files."""
    mime, params = parse_options_header(content_type or "")
    if mime != b"multipart/form-data" or b"boundary" not in params:
        raise UnsupportedMediaError("upload adapters as multipart/form-data")
    body_limit = 2 * limits.max_upload_bytes + limits.max_config_bytes + 64 * 1024
    if content_length is not None and content_length > body_limit:
        raise UploadTooLargeError(f"the upload is larger than {body_limit} bytes")
    sink = _PartSink(staging, limits)
    parser = MultipartParser(params[b"boundary"], sink.callbacks())
    received = 0
    try:
        async for chunk in chunks:
            received += len(chunk)
            if received > body_limit:
                raise UploadTooLargeError(f"the upload is larger than {body_limit} bytes")
            await run_upload_work(parser.write, chunk)  # parts are written to disk: off the event loop
        parser.finalize()
    except MultipartParseError as exc:
        raise UnsafeUploadError(f"malformed multipart body: {exc}") from None
    finally:
        sink.close()
    folder = await run_upload_work(_assemble, sink.files, staging, limits)
    return ReceivedUpload(fields=sink.fields, folder=folder)


async def run_upload_work(fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """Run blocking upload work (unpacking, hashing, copying) in the bounded upload pool."""
    return await asyncio.get_running_loop().run_in_executor(_UPLOAD_POOL, functools.partial(fn, *args, **kwargs))


def _assemble(files: dict[str, Path], staging: Path, limits: UploadLimits) -> Path:
    if "archive" in files:
        if len(files) > 1:
            raise UnsafeUploadError("upload either the two adapter files or one archive, not both")
        folder = staging / "extracted"
        folder.mkdir()
        extract_adapter_archive(files["archive"], folder, limits)
        return folder
    missing = [name for name in _DIRECT_FILES if name not in files]
    if missing:
        raise UnsafeUploadError(f"the upload lacks {', '.join(missing)}")
    return staging
