"""POST /v1/files bodies: multipart/form-data streamed to disk, refused the moment the file passes its limit.

Fields as the openai SDK sends them: `purpose`, the `file` part (with its
filename) and optionally `expires_after[anchor]` / `expires_after[seconds]`.
The file never sits in memory: python-multipart's push parser writes each
chunk to an upload file, in the adapters' bounded upload thread pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from loraplex.adapters.multipart_form import MAX_FIELD_BYTES, MAX_FIELDS, FormParts
from loraplex.adapters.upload import run_upload_work
from loraplex.engine.errors import InvalidRequestError
from loraplex.platform.batches.errors import FileTooLargeError, UnsupportedFileError
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

MAX_FILENAME_CHARS = 256


@dataclass(slots=True)
class ReceivedFile:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    num_bytes: int = 0


class _Parts(FormParts):
    """The one file part into `path`."""

    def __init__(self, path: Path, max_file_bytes: int) -> None:
        super().__init__()
        self.path = path
        self.max_file_bytes = max_file_bytes
        self.received = ReceivedFile(fields=self.fields)

    def open_file(self, name: str, filename: str) -> BinaryIO:
        if name != "file" or self.received.filename is not None:
            raise InvalidRequestError("send exactly one file, in the form field 'file'", param="file")
        self.received.filename = (filename or "upload.jsonl")[:MAX_FILENAME_CHARS]
        return self.path.open("wb")

    def write_file(self, chunk: bytes) -> None:
        self.received.num_bytes += len(chunk)
        if self.received.num_bytes > self.max_file_bytes:
            raise FileTooLargeError(f"the file is larger than the limit of {self.max_file_bytes} bytes "
                                    "(batch_max_file_bytes)", param="file")
        super().write_file(chunk)


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
