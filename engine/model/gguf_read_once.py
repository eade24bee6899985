"""Read a GGUF file's metadata once while transformers converts it.

transformers parses the whole GGUF header in Python three times during one
conversion (for the config, the tokenizer and the weights; ~5 s each on a slow
core, most of the conversion's time, since the 49k-entry vocabulary is read
field by field), and rebuilds gguf's tensor-name table once per submodule
(~400 times for SmolLM2). Within `read_gguf_once()` each reader and table is
built once and shared; both are only read. transformers imports these names
from `gguf` inside its functions, at call time, which is what lets the
module's attributes stand in; with a gguf that lacks them nothing is changed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def read_gguf_once() -> Iterator[None]:
    try:
        import gguf
    except ImportError:
        yield
        return
    real_reader = getattr(gguf, "GGUFReader", None)
    real_name_map = getattr(gguf, "get_tensor_name_map", None)
    if real_reader is None or real_name_map is None:
        yield
        return
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    setattr(gguf, "GGUFReader", shared_reader)  # noqa: B010 (a class stood in for by a function: mypy refuses `=`)
    setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(real_name_map))  # noqa: B010
    try:
        yield
    finally:
        setattr(gguf, "GGUFReader", real_reader)  # noqa: B010
        setattr(gguf, "get_tensor_name_map", real_name_map)  # noqa: B010
