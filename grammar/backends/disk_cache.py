"""Compiled grammars shared by every API server (and engine-core) process of one host, on disk.

The in-process cache (GrammarCompilerService) holds compile futures; this one
holds what a backend can serialize (xgrammar's compiled grammar as JSON), so a
schema compiled by one process is loaded, not compiled again, by the others
and after a restart. One file per key: the key is a SHA-256 of the backend,
its version, the tokenizer's fingerprint and the spec's canonical JSON, so a
different tokenizer or library version never reads another's entry. Writes go
to a temporary file in the same folder and are renamed into place (atomic on
POSIX), so a reader sees a whole entry or none; an unreadable entry is a miss.
Entries over `max_entry_bytes` are not stored; the folder is bounded by the
number of distinct schemas served (remove it to start afresh).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


class GrammarDiskCache:
    def __init__(self, directory: str | Path, max_entry_bytes: int = 64 * 1024 * 1024) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_entry_bytes = max_entry_bytes
        self.num_hits = 0
        self.num_stored = 0

    @staticmethod
    def key(*parts: str) -> str:
        digest = hashlib.sha256()
        for part in parts:
            data = part.encode("utf-8")
            digest.update(len(data).to_bytes(8, "big") + data)  # length-prefixed: no two part lists collide
        return digest.hexdigest()

    def get(self, key: str) -> str | None:
        try:
            text = (self.directory / f"{key}.json").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None
        self.num_hits += 1
        return text

    def put(self, key: str, text: str) -> None:
        data = text.encode("utf-8")
        if len(data) > self.max_entry_bytes:
            return
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".json")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self.directory / f"{key}.json")
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError:
            return  # a full or read-only disk costs a recompilation, never a request
        self.num_stored += 1
