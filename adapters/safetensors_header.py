"""Parse and check a safetensors header ourselves before any library touches the file.

A safetensors file is: 8 bytes little-endian header length N, N bytes of JSON
({name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}),
then the data buffer. A hostile file can lie: offsets past the end, overlapping
tensors, lengths that disagree with dtype x shape, a header length of many GB.
Every such lie is refused here with the tensor's name, reading only the header.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from loraplex.adapters.errors import UnsafeUploadError

DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
MAX_HEADER_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets relative to the data buffer
    end: int


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Return the tensors a safetensors file declares, after checking every offset against its size."""
    file_size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise UnsafeUploadError("adapter_model.safetensors is too short to hold a safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or header_len > file_size - 8:
            raise UnsafeUploadError(
                f"adapter_model.safetensors declares a {header_len}-byte header but the file has "
                f"{file_size} bytes"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: also integers of 4,300+ digits
        raise UnsafeUploadError(f"adapter_model.safetensors header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise UnsafeUploadError("adapter_model.safetensors header is not a JSON object")
    data_size = file_size - 8 - header_len
    entries = [_entry(name, spec, data_size) for name, spec in header.items() if name != "__metadata__"]
    _check_no_overlap(entries)
    return {e.name: e for e in entries}


def _entry(name: str, spec: object, data_size: int) -> TensorEntry:
    if not isinstance(spec, dict):
        raise UnsafeUploadError(f"safetensors entry {name!r} is not an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise UnsafeUploadError(f"tensor {name!r} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise UnsafeUploadError(f"tensor {name!r} has a malformed shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
    ):
        raise UnsafeUploadError(f"tensor {name!r} has malformed data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise UnsafeUploadError(
            f"tensor {name!r} claims bytes [{begin}, {end}) but the data buffer has {data_size} bytes"
        )
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise UnsafeUploadError(
            f"tensor {name!r} spans {end - begin} bytes but {dtype} {shape} needs {expected}"
        )
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _check_no_overlap(entries: list[TensorEntry]) -> None:
    ordered = sorted(entries, key=lambda e: (e.begin, e.end))
    for prev, cur in itertools.pairwise(ordered):
        if cur.begin < prev.end:
            raise UnsafeUploadError(f"tensors {prev.name!r} and {cur.name!r} overlap in the data buffer")
