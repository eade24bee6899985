"""The callbacks of python-multipart's push parser that both upload routes share (adapters, batch files).

Small form fields are kept in memory, each part's headers and each field
bounded, and at most `MAX_FIELDS` of them: without a count, a body of
thousands of 4 KB fields would sit in memory until the upload ended (a
1 GB adapter upload is allowed). File parts are written where the
subclass's `open_file` says, chunk by chunk through `write_file`, which
counts them against the route's own limits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import PurePath
from typing import TYPE_CHECKING, BinaryIO

from loraplex.engine.errors import InvalidRequestError
from python_multipart.multipart import parse_options_header

if TYPE_CHECKING:  # python-multipart declares it for type checkers only
    from python_multipart.multipart import MultipartCallbacks

MAX_FIELD_BYTES = 4096   # a form field's value, and a part's header name or value
MAX_FIELDS = 16          # form fields (not files) in one body
MAX_PART_HEADERS = 16


class FormParts(ABC):
    def __init__(self) -> None:
        self.fields: dict[str, str] = {}
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

    # ---- what a route decides -------------------------------------------------------------------
    @abstractmethod
    def open_file(self, name: str, filename: str) -> BinaryIO:
        """Where the file part `name` (sent as `filename`, its base name) goes; raise to refuse it."""

    def write_file(self, chunk: bytes) -> None:
        """Write one chunk of the open file part, after counting it against the route's limits."""
        assert self._file is not None
        self._file.write(chunk)

    def field_too_long(self, name: str | None) -> Exception:
        return InvalidRequestError(f"form field {name!r} is longer than {MAX_FIELD_BYTES} bytes", param=name)

    # ---- parser callbacks ----------------------------------------------------------------------
    def _header(self, attr: str, data: bytes) -> None:
        value = getattr(self, attr) + data
        if len(value) > MAX_FIELD_BYTES:
            raise InvalidRequestError("a multipart header is too long")
        setattr(self, attr, value)

    def _begin(self) -> None:
        self._headers, self._field, self._buffer = {}, None, bytearray()

    def _header_end(self) -> None:
        if len(self._headers) >= MAX_PART_HEADERS:
            raise InvalidRequestError(f"a multipart part has more than {MAX_PART_HEADERS} headers")
        self._headers[self._header_field.decode("latin-1").lower()] = self._header_value
        self._header_field, self._header_value = b"", b""

    def _headers_finished(self) -> None:
        _, params = parse_options_header(self._headers.get("content-disposition", b""))
        name = params.get(b"name", b"").decode("utf-8", "replace")
        filename = params.get(b"filename")
        if filename is None:
            if len(self.fields) >= MAX_FIELDS:
                raise InvalidRequestError(f"more than {MAX_FIELDS} form fields")
            self._field = name
            return
        base = PurePath(filename.decode("utf-8", "replace").replace("\\", "/")).name.strip()
        self._file = self.open_file(name, base)

    def _data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self._file is not None:
            self.write_file(chunk)
            return
        self._buffer += chunk
        if len(self._buffer) > MAX_FIELD_BYTES:
            raise self.field_too_long(self._field)

    def _end(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        elif self._field:
            self.fields[self._field] = self._buffer.decode("utf-8", "replace")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
