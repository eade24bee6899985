"""KV-cache events as vLLM publishes them, read by a real ZeroMQ SUB socket and decoded as plain msgpack.

The block manager's stores, evictions and the publisher's clears arrive as
three frames (topic `kv@<pod>@<model>`, an 8-byte big-endian sequence number,
msgpack `[ts, [events], dp_rank]`), each event an array led by its tag, in the
field order of vLLM's `BlockStored`/`BlockRemoved`/`AllBlocksCleared`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace

import msgspec
import pytest
import zmq
from local_serving import free_port
from loraplex.engine.kv.block_manager import BlockManager
from loraplex.engine.kv.events import ZmqKVEventPublisher, external_hash, lora_int_id, topic_for
from loraplex.engine.protocol import SamplingParams
from loraplex.engine.sequence import Sequence
from loraplex.platform.metrics_vllm import AdapterNames
from waiting import wait_until

BS = 4
TOPIC = topic_for("10.0.0.7", "SmolLM2-135M-Instruct")


class Subscriber:
    """A SUB socket bound where the publisher connects (llm-d's endpoint picker binds, pods connect)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.socket.bind(f"tcp://127.0.0.1:{self.port}")
        self.heartbeats = 0

    def receive(self, timeout_s: float = 5.0) -> tuple[str, int, list]:
        """The next batch with events (an idle publisher's empty heartbeat batches are counted, then skipped)."""
        deadline = time.monotonic() + timeout_s
        while self.socket.poll(max(int((deadline - time.monotonic()) * 1000), 1)):
            topic, seq, payload = self.socket.recv_multipart()
            batch = msgspec.msgpack.decode(payload)
            self.heartbeats += not batch[1]
            if batch[1]:
                return topic.decode(), int.from_bytes(seq, "big"), batch
        raise AssertionError(f"no KV event batch within {timeout_s} s")

    def events_until(self, predicate, timeout_s: float = 5.0) -> list[list]:  # type: ignore[no-untyped-def]
        """Every event received until one satisfies `predicate` (batches may merge or split events)."""
        deadline = time.monotonic() + timeout_s
        events: list[list] = []
        while not any(predicate(e) for e in events):
            _, _, batch = self.receive(max(deadline - time.monotonic(), 0.01))
            events += batch[1]
        return events

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture
def subscribed() -> Iterator[tuple[Subscriber, ZmqKVEventPublisher]]:
    subscriber = Subscriber()
    names = AdapterNames(lambda adapter_id: SimpleNamespace(name="pirate") if adapter_id == "adp_1" else None)
    publisher = ZmqKVEventPublisher(f"tcp://127.0.0.1:{subscriber.port}", TOPIC, block_size=BS, lora_name=names)
    # A connecting PUB drops what it sends before the connection is up: clear until one batch arrives.

    def reached() -> bool:
        publisher.all_blocks_cleared()
        return bool(subscriber.socket.poll(50))

    wait_until(reached, timeout_s=10, interval_s=0, what="the publisher to reach the subscriber")
    while subscriber.socket.poll(200):
        subscriber.socket.recv_multipart()
    yield subscriber, publisher
    publisher.close()
    subscriber.close()


def seq(tokens: list[int], adapter_id: str | None = None) -> Sequence:
    salt = ("tenant-a", adapter_id, "")
    return Sequence("r", 0, tokens, SamplingParams(), salt[0], salt[1], salt, 0.0)


def prefill(bm: BlockManager, s: Sequence) -> None:
    bm.allocate(s)
    bm.may_append(s, s.num_uncomputed_tokens)
    s.num_computed_tokens = len(s.token_ids)
    bm.cache_blocks(s)


def stored_blocks(events: list[list]) -> list[list]:
    return [e for e in events if e[0] == "BlockStored"]


def test_stores_and_evictions_in_vllms_encoding(subscribed: tuple[Subscriber, ZmqKVEventPublisher]) -> None:
    subscriber, publisher = subscribed
    bm = BlockManager(5, BS, listener=publisher)
    first = seq(list(range(100, 110)), adapter_id="adp_1")  # 2 full blocks (+2 tokens, never cached)
    prefill(bm, first)
    topic, number, batch = subscriber.receive()
    assert topic == TOPIC and number >= 1
    ts, events, rank = batch
    assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
    hashes = [external_hash(h) for h in first.block_hashes]
    assert all(0 <= h < 2**64 for h in hashes)
    # one chain stored in one step is one event, as vLLM sends it
    assert events == [["BlockStored", hashes, None, list(range(100, 108)), BS, lora_int_id("adp_1"), "GPU", "pirate"]]

    # Its blocks stay cached after it ends; a base-model prompt that needs the whole pool evicts them.
    bm.deallocate(first)
    base = seq(list(range(20)))
    prefill(bm, base)
    events = subscriber.events_until(lambda e: e[0] == "BlockStored")
    removed = [h for e in events if e[0] == "BlockRemoved" for h in e[1]]
    assert sorted(removed) == sorted(hashes)
    assert all(len(e) == 3 and e[2] == "GPU" for e in events if e[0] == "BlockRemoved")
    assert events.index(next(e for e in events if e[0] == "BlockRemoved")) < events.index(stored_blocks(events)[0])
    (stored,) = stored_blocks(events)
    assert stored == ["BlockStored", [external_hash(h) for h in base.block_hashes], None, list(range(20)), BS, None,
                      "GPU", None]


def test_a_continuation_names_its_parent_and_sequence_numbers_count_up(
        subscribed: tuple[Subscriber, ZmqKVEventPublisher]) -> None:
    subscriber, publisher = subscribed
    bm = BlockManager(16, BS, listener=publisher)
    first = seq(list(range(9)))
    prefill(bm, first)
    _, number, batch = subscriber.receive()
    assert stored_blocks(batch[1])[0][1] == [external_hash(h) for h in first.block_hashes]
    more = seq([*range(9), 200, 201, 202, 203])  # its first 2 blocks are cached: only the third is new
    prefill(bm, more)
    _, next_number, batch = subscriber.receive()
    assert next_number > number  # every batch is numbered, empty heartbeats too
    assert stored_blocks(batch[1]) == [["BlockStored", [external_hash(more.block_hashes[2])],
                                        external_hash(more.block_hashes[1]), [8, 200, 201, 202], BS, None, "GPU", None]]

    publisher.all_blocks_cleared()
    _, cleared_number, batch = subscriber.receive()
    assert cleared_number > next_number and batch[1] == [["AllBlocksCleared"]]
    publisher.close()  # a closing engine's cache is gone too
    _, last_number, batch = subscriber.receive()
    assert last_number > cleared_number and batch[1] == [["AllBlocksCleared"]]


def test_an_idle_publisher_sends_empty_batches(subscribed: tuple[Subscriber, ZmqKVEventPublisher]) -> None:
    subscriber, _ = subscribed
    deadline = time.monotonic() + 5
    while subscriber.heartbeats < 2:
        assert subscriber.socket.poll(int(max(deadline - time.monotonic(), 0) * 1000) + 1), "no heartbeat"
        topic, _, payload = subscriber.socket.recv_multipart()
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert topic.decode() == TOPIC and events == [] and rank == 0 and ts > 0
        subscriber.heartbeats += 1
