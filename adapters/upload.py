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
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, BinaryIO, TypeVar

from loraplex.adapters.archive import UploadLimits, extract_adapter_archive
from loraplex.adapters.errors import UnsafeUploadError, UnsupportedMediaError, UploadTooLargeError
from loraplex.adapters.peft_format import CONFIG_NAME, PICKLE_SUFFIXES, WEIGHTS_NAME
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

if TYPE_CHECKING:  # python-multipart declares it for type checkers only
    from python_multipart.multipart import MultipartCallbacks

MAX_FIELD_BYTES = 4096
UPLOAD_WORKERS = 2
T = TypeVar("T")
_UPLOAD_POOL = ThreadPoolExecutor(max_workers=UPLOAD_WORKERS, thread_name_prefix="adapter-upload")
_ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz")
_DIRECT_FILES = (CONFIG_NAME, WEIGHTS_NAME)


@dataclass(slots=True)
class ReceivedUpload:
    fields: dict[str, str] = field(default_factory=dict)
    folder: Path | None = None  # holds adapter_config.json + adapter_model.safetensors once complete


class _PartSink:
    """Callbacks for one multipart body: routes each part to a field buffer or a staging file."""

    def __init__(self, staging: Path, limits: UploadLimits) -> None:
        self.staging = staging
        self.limits = limits
        self.fields: dict[str, str] = {}
        self.files: dict[str, Path] = {}  # kept file name -> path
        self._header_field = b""
        self._header_value = b""
        self._headers: dict[str, bytes] = {}
        self._field_name: str | None = None
        self._field_buf = bytearray()
        self._file: BinaryIO | None = None
        self._file_bytes = 0

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda d, s, e: self._add("_header_field", d[s:e]),
            "on_header_value": lambda d, s, e: self._add("_header_value", d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
        }

    def _add(self, attr: str, data: bytes) -> None:
        setattr(self, attr, getattr(self, attr) + data)

    def _part_begin(self) -> None:
        self._headers, self._field_name, self._field_buf, self._file, self._file_bytes = {}, None, bytearray(), None, 0

    def _header_end(self) -> None:
        self._headers[self._header_field.decode("latin-1").lower()] = self._header_value
        self._header_field, self._header_value = b"", b""

    def _headers_finished(self) -> None:
        _, params = parse_options_header(self._headers.get("content-disposition", b""))
        name = params.get(b"name", b"").decode("utf-8", "replace")
        filename = params.get(b"filename")
        if filename is None:
            self._field_name = name
            return
        base = PurePath(filename.decode("utf-8", "replace").replace("\\", "/")).name
        if base.endswith(PICKLE_SUFFIXES):
            raise UnsafeUploadError(f"{base}: pickled weights are refused; upload adapter_model.safetensors")
        if base in _DIRECT_FILES:
            kept = base
        elif base.endswith(_ARCHIVE_SUFFIXES):
            kept = "archive"
        else:
            raise UnsupportedMediaError(
                f"unexpected file {base!r}: upload {CONFIG_NAME} and {WEIGHTS_NAME}, or one .zip / .tar.gz"
            )
        if kept in self.files:
            raise UnsafeUploadError(f"more than one {kept} in the upload")
        path = self.staging / ("upload.archive" if kept == "archive" else kept)
        self.files[kept] = path
        self._file = path.open("wb")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self._file is None:
            self._field_buf += chunk
            if len(self._field_buf) > MAX_FIELD_BYTES:
                raise UploadTooLargeError(f"form field {self._field_name!r} is longer than {MAX_FIELD_BYTES} bytes")
            return
        self._file_bytes += len(chunk)
        if self._file_bytes > self.limits.max_upload_bytes:
            raise UploadTooLargeError(f"an uploaded file is larger than {self.limits.max_upload_bytes} bytes")
        self._file.write(chunk)

    def _part_end(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        elif self._field_name:
            self.fields[self._field_name] = self._field_buf.decode("utf-8", "replace")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


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
