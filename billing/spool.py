"""Durable holding for usage events the ledger could not take (the database was unavailable).

Two spools with one interface: a Redis stream (when Redis is configured) and
append-only local files with fsync. Draining re-writes the events through the
idempotent ledger and only then acknowledges them, so a crash between the two
re-delivers a batch the ledger already has, which it ignores: nothing is lost
and nothing is counted twice.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from loraplex.billing.events import UsageEvent


@dataclass(slots=True)
class SpoolBatch:
    events: list[UsageEvent]
    handle: Any = field(repr=False)  # what `ack` needs to forget exactly these events


class Spool(Protocol):
    def append(self, events: list[UsageEvent]) -> None:
        """Store durably; raise OSError or a Redis error if that is impossible."""

    def peek(self, limit: int) -> SpoolBatch | None:
        """The oldest unacknowledged events (at most `limit`), or None when empty."""

    def ack(self, batch: SpoolBatch) -> None:
        """Forget a batch after the ledger has it."""

    def num_pending(self) -> int: ...


class FileSpool:
    """One append-only JSON-lines segment per process, under `directory`, fsynced on every append.

    Each process holds an exclusive lock on its own segment; `peek` also takes
    over segments whose lock is free (their process died), so a restarted
    server drains what the killed one left. A segment's progress is a byte
    offset in `<segment>.offset`, replaced atomically.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._dir = Path(directory)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._own = self._dir / f"spool-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        self._locks: dict[Path, int] = {}
        self._claim(self._own, create=True)

    def append(self, events: list[UsageEvent]) -> None:
        if not events:
            return
        payload = "".join(event.to_json() + "\n" for event in events).encode()
        fd = os.open(self._own, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)

    def peek(self, limit: int) -> SpoolBatch | None:
        for segment in self._segments():
            offset = self._read_offset(segment)
            events: list[UsageEvent] = []
            end = offset
            with open(segment, "rb") as handle:
                handle.seek(offset)
                while len(events) < limit:
                    line = handle.readline()
                    if not line.endswith(b"\n"):
                        break  # end of file, or a torn last line from a crash mid-append
                    end += len(line)
                    events.append(UsageEvent.from_json(line.decode()))
            if events:
                return SpoolBatch(events=events, handle=(segment, end))
            self._compact(segment, offset)
        return None

    def ack(self, batch: SpoolBatch) -> None:
        segment, end = batch.handle
        self._write_offset(segment, end)
        self._compact(segment, end)

    def num_pending(self) -> int:
        pending = 0
        for segment in self._segments():
            with open(segment, "rb") as handle:
                handle.seek(self._read_offset(segment))
                pending += sum(1 for line in handle if line.endswith(b"\n"))
        return pending

    def close(self) -> None:
        for fd in self._locks.values():
            os.close(fd)
        self._locks.clear()

    def _segments(self) -> list[Path]:
        segments = [self._own]
        for path in sorted(self._dir.glob("spool-*.jsonl")):
            if path != self._own and (path in self._locks or self._claim(path)):
                segments.append(path)
        return segments

    def _claim(self, segment: Path, *, create: bool = False) -> bool:
        lock_path = segment.with_suffix(".lock")
        if not create and not lock_path.exists():
            return False
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        if create:
            segment.touch()
            _fsync_dir(self._dir)
        self._trim_torn_tail(segment)
        self._locks[segment] = fd
        return True

    def _read_offset(self, segment: Path) -> int:
        try:
            offset = int(segment.with_suffix(".offset").read_text() or 0)
        except FileNotFoundError:
            return 0
        # Larger than the file: we crashed between truncating the segment and resetting the offset.
        return offset if offset <= segment.stat().st_size else 0

    def _write_offset(self, segment: Path, offset: int) -> None:
        target = segment.with_suffix(".offset")
        temporary = target.with_suffix(".offset.tmp")
        with open(temporary, "w") as handle:
            handle.write(str(offset))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
        _fsync_dir(self._dir)

    def _compact(self, segment: Path, offset: int) -> None:
        """Once everything in a segment is acknowledged, empty it (or delete a dead process's one)."""
        if offset != segment.stat().st_size or (offset == 0 and segment == self._own):
            return
        if segment == self._own:
            os.truncate(segment, 0)
            self._write_offset(segment, 0)
            return
        segment.unlink()
        segment.with_suffix(".offset").unlink(missing_ok=True)
        segment.with_suffix(".lock").unlink(missing_ok=True)
        os.close(self._locks.pop(segment))

    @staticmethod
    def _trim_torn_tail(segment: Path) -> None:
        """A crash mid-append can leave half a line; cut it so the next append starts a fresh line."""
        with open(segment, "rb+") as handle:
            data = handle.read()
            if data and not data.endswith(b"\n"):
                handle.truncate(data.rfind(b"\n") + 1)
                os.fsync(handle.fileno())


class RedisStreamSpool:
    """Events as entries of one Redis stream; durability is Redis's (run it with appendonly yes)."""

    def __init__(self, client: Any, key: str) -> None:
        self._redis = client
        self._key = key

    def append(self, events: list[UsageEvent]) -> None:
        if not events:
            return
        pipe = self._redis.pipeline(transaction=True)
        for event in events:
            pipe.xadd(self._key, {"event": event.to_json()})
        pipe.execute()

    def peek(self, limit: int) -> SpoolBatch | None:
        entries = self._redis.xrange(self._key, count=limit)
        if not entries:
            return None
        events = [UsageEvent.from_json(_text(fields.get(b"event") or fields["event"])) for _, fields in entries]
        return SpoolBatch(events=events, handle=[entry_id for entry_id, _ in entries])

    def ack(self, batch: SpoolBatch) -> None:
        self._redis.xdel(self._key, *batch.handle)

    def num_pending(self) -> int:
        return int(self._redis.xlen(self._key))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
