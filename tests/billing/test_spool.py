"""Spools keep events durably until acknowledged, across process deaths (file) and in Redis."""

from __future__ import annotations

import os

from loraplex.billing.spool import FileSpool, RedisStreamSpool


def _drain(spool, limit: int = 3) -> list[str]:
    seen = []
    while (batch := spool.peek(limit)) is not None:
        seen += [e.request_id for e in batch.events]
        spool.ack(batch)
    return seen


def test_file_spool_round_trip_and_compaction(tmp_path, make_event):
    spool = FileSpool(tmp_path)
    events = [make_event(f"r{i}") for i in range(7)]
    spool.append(events[:4])
    spool.append(events[4:])
    assert spool.num_pending() == 7
    batch = spool.peek(5)
    assert [e for e in batch.events] == events[:5]
    assert spool.peek(5).events == events[:5], "peek without ack re-delivers"
    spool.ack(batch)
    assert spool.num_pending() == 2
    assert _drain(spool) == ["r5", "r6"]
    assert spool.num_pending() == 0
    segments = list(tmp_path.glob("spool-*.jsonl"))
    assert len(segments) == 1 and segments[0].stat().st_size == 0, "a fully acked segment is emptied"
    spool.close()


def test_file_spool_survives_its_process_and_is_taken_over(tmp_path, make_event):
    dead = FileSpool(tmp_path)
    dead.append([make_event("left1"), make_event("left2")])
    other = FileSpool(tmp_path)
    assert other.num_pending() == 0, "a live process's segment is locked and not touched"
    dead.close()  # its process dies: the lock is released
    assert _drain(other) == ["left1", "left2"]
    assert len(list(tmp_path.glob("spool-*.jsonl"))) == 1, "the dead segment is deleted once drained"
    other.close()


def test_file_spool_cuts_a_torn_last_line(tmp_path, make_event):
    dead = FileSpool(tmp_path)
    dead.append([make_event("whole")])
    segment = next(tmp_path.glob("spool-*.jsonl"))
    with open(segment, "ab") as handle:
        handle.write(b'{"request_id":"torn","ten')  # the process died mid-append
    dead.close()
    taker = FileSpool(tmp_path)
    assert _drain(taker) == ["whole"]
    taker.close()


def test_file_spool_offset_beyond_segment_restarts_at_zero(tmp_path, make_event):
    spool = FileSpool(tmp_path)
    segment = next(tmp_path.glob("spool-*.jsonl"))
    spool.append([make_event("a")])
    # Crash between truncating the segment and resetting the offset: offset > size.
    segment.with_suffix(".offset").write_text("99999")
    assert _drain(spool) == ["a"]
    assert os.path.getsize(segment) == 0
    spool.close()


def test_redis_stream_spool(redis_client, key_prefix, make_event):
    spool = RedisStreamSpool(redis_client, key_prefix)
    spool.append([make_event(f"r{i}") for i in range(5)])
    assert spool.num_pending() == 5
    assert spool.peek(2).events[0].request_id == "r0"
    assert _drain(spool, limit=2) == [f"r{i}" for i in range(5)]
    assert spool.num_pending() == 0
