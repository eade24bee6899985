"""The meter's write-ahead journal: every usage event is stored here durably before its request ends.

Two spools with one interface: Redis streams (when Redis is configured) and
append-only local files with fsync. The meter's writer moves events from the
spool into the idempotent ledger and only then acknowledges them, so a crash
between the two re-delivers a batch the ledger already has, which it ignores:
nothing is lost and nothing is counted twice. A spool left behind by a dead
process (SIGKILL, power loss) is taken over by the next process that starts.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
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

    def keep_alive(self) -> None:
        """Tell other processes this one is alive (so they leave its spool alone)."""

    def close(self) -> None: ...


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
        # The meter appends on one thread (requests wait for it) and drains on another. Draining (reading,
        # parsing, writing offsets, each with its fsyncs) holds `_mutex` only; an append holds `_append_lock`
        # only, which compaction also takes for its size check and truncation, so it never truncates an append.
        # Requests thus wait for their own fsync, never behind the writer's reads and offset writes.
        self._mutex = threading.RLock()
        self._append_lock = threading.Lock()
        self._claim(self._own, create=True)

    def append(self, events: list[UsageEvent]) -> None:
        if not events:
            return
        payload = "".join(event.to_json() + "\n" for event in events).encode()
        with self._append_lock:
            fd = os.open(self._own, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, payload)
                os.fsync(fd)
            finally:
                os.close(fd)

    def peek(self, limit: int) -> SpoolBatch | None:
        with self._mutex:
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
        with self._mutex:
            segment, end = batch.handle
            self._write_offset(segment, end)
            self._compact(segment, end)

    def num_pending(self) -> int:
        with self._mutex:
            pending = 0
            for segment in self._segments():
                with open(segment, "rb") as handle:
                    handle.seek(self._read_offset(segment))
                    pending += sum(1 for line in handle if line.endswith(b"\n"))
            return pending

    def keep_alive(self) -> None:
        """Nothing to do: the segment's flock is held for as long as this process lives."""

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
            with self._append_lock:  # no append lands between the size check and the truncation
                if offset != segment.stat().st_size:
                    return  # an append just came in: compact on a later pass
                os.truncate(segment, 0)
                # Before any append: a larger offset after a crash here reads as 0 (see _read_offset), but
                # appends past it would be skipped.
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
    """One Redis stream per process, kept alive by a lease; a dead process's stream is adopted and drained.

    Why one stream per process: with one shared stream every replica's writer
    would read (and write to the ledger) the same oldest entries. Each process
    registers its stream in a set and holds a lease key refreshed by
    `keep_alive()`; when a lease expires (the process died, SIGKILL included),
    the next `peek` of another process claims it with SET NX and drains that
    stream too. Durability is Redis's (run it with appendonly yes).
    """

    # Delete a drained stream only if it is still empty: an append may race with the adopter's check.
    _RETIRE_IF_EMPTY = """
    if redis.call('XLEN', KEYS[1]) == 0 then
        redis.call('DEL', KEYS[1], KEYS[2])
        redis.call('SREM', KEYS[3], ARGV[1])
        return 1
    end
    return 0
    """
    # Refresh a lease we hold (or that lapsed); never take one another process has adopted meanwhile.
    _RENEW = """
    local holder = redis.call('GET', KEYS[1])
    if holder == false or holder == ARGV[1] then
        redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
        return 1
    end
    return 0
    """

    def __init__(self, client: Any, key_prefix: str, *, lease_s: float = 10.0) -> None:
        self._redis = client
        self._prefix = key_prefix
        self._lease_ms = max(int(lease_s * 1000), 100)
        self._id = uuid.uuid4().hex
        self._registry = f"{key_prefix}billing:journals"
        self._adopted: list[str] = []           # ids of dead processes' streams we drain
        self._next_adoption_scan = 0.0
        self._retire = client.register_script(self._RETIRE_IF_EMPTY)
        self._renew = client.register_script(self._RENEW)
        self._registered = False

    @property
    def instance_id(self) -> str:
        return self._id

    def append(self, events: list[UsageEvent]) -> None:
        if not events:
            return
        self._ensure_registered()
        pipe = self._redis.pipeline(transaction=True)
        for event in events:
            pipe.xadd(self._stream(self._id), {"event": event.to_json()})
        # Again on every append: an adopter that drained our stream while we stalled unregistered it.
        pipe.sadd(self._registry, self._id)
        pipe.execute()

    def peek(self, limit: int) -> SpoolBatch | None:
        for owner in [self._id, *self._adopted_streams()]:
            entries = self._redis.xrange(self._stream(owner), count=limit)
            if entries:
                events = [UsageEvent.from_json(_text(fields.get(b"event") or fields["event"])) for _, fields in entries]
                return SpoolBatch(events=events, handle=(owner, [entry_id for entry_id, _ in entries]))
            if owner != self._id:
                self._retire_adopted(owner)
        return None

    def ack(self, batch: SpoolBatch) -> None:
        owner, entry_ids = batch.handle
        self._redis.xdel(self._stream(owner), *entry_ids)

    def num_pending(self) -> int:
        return sum(int(self._redis.xlen(self._stream(owner))) for owner in [self._id, *self._adopted])

    def keep_alive(self) -> None:
        """Renew our lease and those of adopted streams; call more often than the lease lasts."""
        self._ensure_registered()
        for owner in [self._id, *self._adopted]:
            self._renew(keys=[self._lease(owner)], args=[self._id, self._lease_ms])

    def close(self) -> None:
        """Clean shutdown: drop our stream if empty, else let the lease go so another process adopts it now."""
        for owner in [self._id, *self._adopted]:
            if not self._retire(keys=[self._stream(owner), self._lease(owner), self._registry], args=[owner]):
                self._redis.delete(self._lease(owner))
        self._adopted.clear()
        self._registered = False

    def _ensure_registered(self) -> None:
        if not self._registered:
            pipe = self._redis.pipeline(transaction=True)
            pipe.sadd(self._registry, self._id)
            pipe.set(self._lease(self._id), self._id, px=self._lease_ms)
            pipe.execute()
            self._registered = True

    def _adopted_streams(self) -> list[str]:
        """Claim the streams whose owners' leases lapsed (checked at most twice a lease period)."""
        now = time.monotonic()
        if now >= self._next_adoption_scan:
            self._next_adoption_scan = now + self._lease_ms / 2000
            for raw in self._redis.smembers(self._registry):
                owner = _text(raw)
                if owner == self._id or owner in self._adopted:
                    continue
                if self._redis.set(self._lease(owner), self._id, px=self._lease_ms, nx=True):
                    self._adopted.append(owner)
        return list(self._adopted)

    def _retire_adopted(self, owner: str) -> None:
        if self._retire(keys=[self._stream(owner), self._lease(owner), self._registry], args=[owner]):
            self._adopted.remove(owner)

    def _stream(self, owner: str) -> str:
        return f"{self._prefix}billing:journal:{owner}"

    def _lease(self, owner: str) -> str:
        return f"{self._prefix}billing:journal-lease:{owner}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
