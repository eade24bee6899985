"""KV-cache events in vLLM's wire format, published over ZeroMQ for prefix-aware routers (llm-d).

The block manager tells its `listener` when a block enters the prefix cache
(its K/V computed, or copied back from the host tier) and when a cached block
is evicted. `ZmqKVEventPublisher` is that listener: the engine thread only
appends to a queue; a publisher thread merges what a few milliseconds brought
into one batch and sends it on a PUB socket, as vLLM's `ZmqEventPublisher`
does: three frames, the topic (`kv@<pod>@<model>`), an 8-byte big-endian
sequence number, and the msgpack of `[ts, [events], data_parallel_rank]`
where each event is an array whose first element is its tag:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

Hashes go out as unsigned 64-bit integers (the last 8 bytes of ours, as vLLM
turns its own into integers); subscribers treat them as opaque keys and hash
the token ids and adapter name themselves. A fresh publisher first announces
AllBlocksCleared (a restarted engine's cache is empty), and so does a closing
one. Without a subscriber, PUB drops the batches: the engine never waits.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import zmq

if TYPE_CHECKING:
    from loraplex.engine.kv.block_manager import CacheSalt

log = logging.getLogger(__name__)

# ("stored", block hash, parent hash, token ids, adapter id) | ("removed", block hash) | ("cleared",)
PendingEvent = tuple[Any, ...]

MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own KV pool (ours also on the CPU device)


class KVCacheListener(Protocol):
    """What the block manager reports; called on the engine thread, so it must not block."""

    def block_stored(self, block_hash: bytes, parent_hash: bytes, token_ids: list[int], salt: CacheSalt) -> None: ...

    def block_removed(self, block_hash: bytes) -> None: ...


# ---- vLLM's event types (vllm/distributed/kv_events.py), encoded as arrays -----------------------------

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; the tag (the class name) is each array's first element."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[-8:], "big")


def lora_int_id(adapter_id: str) -> int:
    """A stable positive id for an adapter (vLLM's deprecated `lora_id` field; `lora_name` is what counts)."""
    return int.from_bytes(hashlib.blake2b(adapter_id.encode(), digest_size=4).digest(), "big") & 0x7FFFFFFF or 1


def topic_for(pod: str, model: str) -> str:
    return f"kv@{pod}@{model}"


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or local endpoint is bound, a host:port is connected to (the subscriber binds)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKVEventPublisher:
    def __init__(self, endpoint: str, topic: str, *, block_size: int,
                 lora_name: Callable[[str], str | None] = lambda _adapter_id: None,
                 flush_interval_s: float = 0.01, heartbeat_s: float = 0.2, data_parallel_rank: int = 0,
                 hwm: int = 100_000) -> None:
        """`lora_name(adapter_id)`: the name requests use for that adapter (called on the publisher thread)."""
        self.topic = topic.encode()
        self.block_size = block_size
        self._lora_name = lora_name
        self._flush_interval_s = flush_interval_s
        self._heartbeat_s = heartbeat_s
        self._last_sent = 0.0
        self._rank = data_parallel_rank
        self._pending: deque[PendingEvent] = deque()  # appended by the engine thread, drained by the publisher's
        self._encoder = msgspec.msgpack.Encoder()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.set_hwm(hwm)
        self._socket.setsockopt(zmq.LINGER, 1000)
        if should_bind(endpoint):
            self._socket.bind(endpoint)
        else:
            self._socket.connect(endpoint)
        self.endpoint = endpoint
        self.num_batches = 0
        self._seq = 0
        self._names: dict[str, str | None] = {}
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._pending.append(("cleared",))
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ---- the listener (engine thread) -----------------------------------------------------------
    def block_stored(self, block_hash: bytes, parent_hash: bytes, token_ids: list[int], salt: CacheSalt) -> None:
        self._pending.append(("stored", block_hash, parent_hash, token_ids, salt[1] if len(salt) > 1 else None))

    def block_removed(self, block_hash: bytes) -> None:
        self._pending.append(("removed", block_hash))

    def all_blocks_cleared(self) -> None:
        self._pending.append(("cleared",))

    # ---- the publisher thread -------------------------------------------------------------------
    def close(self) -> None:
        """Announce the cache gone, send what is queued, and close the socket (once)."""
        if self._stopped.is_set():
            return
        self._pending.append(("cleared",))
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=1000)
        self._context.term()

    def _run(self) -> None:
        self._send([])  # primes the socket (see _publish_pending) before the first real batch
        while not self._stopped.is_set():
            self._wake.wait(self._flush_interval_s)
            self._publish_pending()
        self._publish_pending()

    def _publish_pending(self) -> None:
        """What the engine reported since the last batch, as one batch. An idle publisher sends an empty batch
        every `heartbeat_s`: a PUB socket takes in a newly connected subscriber's subscription only while it
        sends, and drops that send, so without them the first batch after every (re)connection is lost."""
        items = []
        while self._pending:
            items.append(self._pending.popleft())
        if items:
            try:
                self._send(self._events(items))
            except Exception:
                log.exception("kv events: could not publish a batch")
        elif time.monotonic() - self._last_sent >= self._heartbeat_s:
            self._send([])

    def _send(self, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank))
        self._last_sent = time.monotonic()
        try:
            self._socket.send_multipart([self.topic, self._seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        except zmq.Again:
            log.debug("kv events: no subscriber is keeping up; dropping a batch")
            return
        self._seq += 1
        self.num_batches += 1

    def _events(self, items: list[PendingEvent]) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """Consecutive stores of one chain (each block's parent is the one before) become one BlockStored."""
        events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        last_stored: bytes | None = None
        last_adapter: str | None = None
        for item in items:
            kind = item[0]
            if kind == "stored":
                _, block_hash, parent, token_ids, adapter_id = item
                previous = events[-1] if events else None
                if isinstance(previous, BlockStored) and parent == last_stored and adapter_id == last_adapter:
                    previous.block_hashes.append(external_hash(block_hash))
                    previous.token_ids.extend(token_ids)
                else:
                    events.append(BlockStored(
                        block_hashes=[external_hash(block_hash)],
                        parent_block_hash=external_hash(parent) if parent else None,
                        token_ids=list(token_ids), block_size=self.block_size,
                        lora_id=lora_int_id(adapter_id) if adapter_id else None, medium=MEDIUM_GPU,
                        lora_name=self._name(adapter_id) if adapter_id else None,
                    ))
                last_stored, last_adapter = block_hash, adapter_id
                continue
            last_stored = None
            if kind == "removed":
                previous = events[-1] if events else None
                if isinstance(previous, BlockRemoved):
                    previous.block_hashes.append(external_hash(item[1]))
                else:
                    events.append(BlockRemoved(block_hashes=[external_hash(item[1])], medium=MEDIUM_GPU))
            else:
                events.append(AllBlocksCleared())
        return events

    def _name(self, adapter_id: str) -> str | None:
        if adapter_id not in self._names:
            try:
                self._names[adapter_id] = self._lora_name(adapter_id)
            except Exception:
                log.exception("kv events: could not look up the name of adapter %s", adapter_id)
                return None
            if len(self._names) > 10_000:
                self._names.pop(next(iter(self._names)))
        return self._names[adapter_id]
