"""POST /v1/files bodies: multipart/form-data streamed to disk, refused the moment the file passes its limit.

Fields as the openai SDK sends them: `purpose`, the `file` part (with its
filename) and optionally `expires_after[anchor]` / `expires_after[seconds]`.
The file never sits in memory: python-multipart's push parser writes each
chunk to an upload file, in the adapters' bounded upload thread pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, BinaryIO

from loraplex.adapters.upload import run_upload_work
from loraplex.engine.errors import InvalidRequestError
from loraplex.platform.batches.errors import FileTooLargeError, UnsupportedFileError
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

if TYPE_CHECKING:  # python-multipart declares it for type checkers only
    from python_multipart.multipart import MultipartCallbacks

MAX_FIELD_BYTES = 4096
MAX_FIELDS = 16
MAX_FILENAME_CHARS = 256


@dataclass(slots=True)
class ReceivedFile:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    num_bytes: int = 0


class _Parts:
    """python-multipart callbacks: small form fields into memory, the one file part into `path`."""

    def __init__(self, path: Path, max_file_bytes: int) -> None:
        self.path = path
        self.max_file_bytes = max_file_bytes
        self.received = ReceivedFile()
        self._header_field = b""
        self._header_value = b""
        self._headers: dict[str, bytes] = {}
        self._field: str | None = None
        self._buffer = bytearray()
        self._file: BinaryIO | None = None

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda d, s, e: self._header("_header_field", d[s:e]),
            "on_header_value": lambda d, s, e: self._header("_header_value", d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._data,
            "on_part_end": self._end,
        }

    def _header(self, attr: str, data: bytes) -> None:
        value = getattr(self, attr) + data
        if len(value) > MAX_FIELD_BYTES:
            raise InvalidRequestError("a multipart header is too long")
        setattr(self, attr, value)

    def _begin(self) -> None:
        self._headers, self._field, self._buffer = {}, None, bytearray()

    def _header_end(self) -> None:
        self._headers[self._header_field.decode("latin-1").lower()] = self._header_value
        self._header_field, self._header_value = b"", b""

    def _headers_finished(self) -> None:
        _, params = parse_options_header(self._headers.get("content-disposition", b""))
        name = params.get(b"name", b"").decode("utf-8", "replace")
        filename = params.get(b"filename")
        if filename is None:
            if len(self.received.fields) >= MAX_FIELDS:
                raise InvalidRequestError(f"more than {MAX_FIELDS} form fields")
            self._field = name
            return
        if name != "file" or self.received.filename is not None:
            raise InvalidRequestError("send exactly one file, in the form field 'file'", param="file")
        base = PurePath(filename.decode("utf-8", "replace").replace("\\", "/")).name.strip()
        self.received.filename = (base or "upload.jsonl")[:MAX_FILENAME_CHARS]
        self._file = self.path.open("wb")

    def _data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self._file is None:
            self._buffer += chunk
            if len(self._buffer) > MAX_FIELD_BYTES:
                raise InvalidRequestError(f"form field {self._field!r} is longer than {MAX_FIELD_BYTES} bytes",
                                          param=self._field)
            return
        self.received.num_bytes += len(chunk)
        if self.received.num_bytes > self.max_file_bytes:
            raise FileTooLargeError(f"the file is larger than the limit of {self.max_file_bytes} bytes "
                                    "(batch_max_file_bytes)", param="file")
        self._file.write(chunk)

    def _end(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        elif self._field:
            self.received.fields[self._field] = self._buffer.decode("utf-8", "replace")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


async def receive_file(chunks: AsyncIterator[bytes], content_type: str, path: Path, *, max_file_bytes: int,
                       content_length: int | None) -> ReceivedFile:
    """Parse the body, the file part into `path` (which the caller removes)."""
    mime, params = parse_options_header(content_type or "")
    if mime != b"multipart/form-data" or b"boundary" not in params:
        raise UnsupportedFileError("upload files as multipart/form-data with the fields 'purpose' and 'file'")
    body_limit = max_file_bytes + MAX_FIELDS * (MAX_FIELD_BYTES + 512) + 64 * 1024
    if content_length is not None and content_length > body_limit:
        raise FileTooLargeError(f"the file is larger than the limit of {max_file_bytes} bytes (batch_max_file_bytes)",
                                param="file")
    parts = _Parts(path, max_file_bytes)
    parser = MultipartParser(params[b"boundary"], parts.callbacks())
    try:
        async for chunk in chunks:
            await run_upload_work(parser.write, chunk)
        parser.finalize()
    except MultipartParseError as exc:
        raise InvalidRequestError(f"malformed multipart body: {exc}") from None
    finally:
        parts.close()
    if parts.received.filename is None:
        raise InvalidRequestError("the form field 'file' is required", param="file")
    return parts.received
