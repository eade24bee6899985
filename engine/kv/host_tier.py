"""Host-memory tier for pinned session KV: offload under pressure, restore on the next turn.

Plain Python over integers, like the block manager: it decides which host
slots hold which session's blocks and records the copies; the runner moves
the bytes at the start of the next step, in the order recorded (so a slot or
block reused within one step is read before it is overwritten). When the
host budget is spent, the least recently offloaded sessions are dropped;
their next turn re-prefills from the transcript.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraplex.engine.kv.block_manager import Block, BlockManager, CacheSalt

TO_HOST = "to_host"      # (TO_HOST, device block id, host slot)
TO_DEVICE = "to_device"  # (TO_DEVICE, host slot, device block id)


@dataclass(slots=True)
class HostBlock:
    slot: int
    hash: bytes
    parent_hash: bytes
    salt: CacheSalt
    token_ids: list[int]


class HostTier:
    def __init__(self, num_host_blocks: int) -> None:
        self.num_host_blocks = num_host_blocks
        self.free_slots: deque[int] = deque(range(num_host_blocks))
        self.sessions: OrderedDict[str, list[HostBlock]] = OrderedDict()  # oldest offload first
        self.swaps: list[tuple[str, int, int]] = []
        self.num_offloads = 0
        self.num_restores = 0
        self.num_drops = 0
        self.num_blocks_copied_in = 0  # restored blocks that had to come back from host memory

    @property
    def num_used_slots(self) -> int:
        return self.num_host_blocks - len(self.free_slots)

    def offload(self, key: str, blocks: list[Block]) -> bool:
        """Copy a session's pinned blocks to host slots; False (dropped) if they can never fit."""
        self.discard(key)
        if not blocks:
            return True
        if len(blocks) > self.num_host_blocks:
            self.num_drops += 1
            return False
        while len(self.free_slots) < len(blocks):
            self._drop_oldest()
        entries = []
        for block in blocks:
            slot = self.free_slots.popleft()
            self.swaps.append((TO_HOST, block.block_id, slot))
            entries.append(HostBlock(slot, block.hash or b"", block.parent_hash, block.salt, list(block.token_ids)))
        self.sessions[key] = entries
        self.num_offloads += 1
        return True

    def offload_if_room(self, key: str, blocks: list[tuple[int, bytes, bytes, CacheSalt, list[int]]]) -> bool:
        """Copy `(device block id, hash, parent hash, salt, token ids)` blocks to free host slots, dropping no
        session for them; False (nothing copied) when they do not fit (a preempted sequence then recomputes)."""
        if not blocks or len(blocks) > len(self.free_slots):
            return False
        entries = []
        for block_id, h, parent, salt, token_ids in blocks:
            slot = self.free_slots.popleft()
            self.swaps.append((TO_HOST, block_id, slot))
            entries.append(HostBlock(slot, h, parent, salt, list(token_ids)))
        self.sessions[key] = entries
        return True

    def restore(self, key: str, block_manager: BlockManager) -> list[int] | None:
        """Bring a session's blocks back onto the device and into the prefix cache.

        Returns the device block ids (each holding one reference, for the pin),
        or None when the session is not on the host or the device has no room
        now (it stays on the host; this turn re-prefills).
        """
        entries = self.sessions.get(key)
        if entries is None:
            return None
        # Blocks still in the device prefix cache are reused as they are: reference them first,
        # so allocating the missing ones cannot recycle them.
        on_device = [block_manager.cached_block(e.hash, e.token_ids, e.salt, e.parent_hash) for e in entries]
        for block_id in on_device:
            if block_id is not None:
                block_manager.take_ref(block_id)
        if sum(block_id is None for block_id in on_device) > block_manager.num_free_blocks:
            for block_id in on_device:
                if block_id is not None:
                    block_manager.release_ref(block_id)
            return None
        block_ids = []
        for entry, block_id in zip(entries, on_device, strict=True):
            if block_id is None:
                block_id = block_manager.take_block_for(entry.hash, entry.token_ids, entry.salt, entry.parent_hash)
                self.swaps.append((TO_DEVICE, entry.slot, block_id))
                self.num_blocks_copied_in += 1
            block_ids.append(block_id)
            self.free_slots.append(entry.slot)
        del self.sessions[key]
        self.num_restores += 1
        return block_ids

    def discard(self, key: str) -> bool:
        entries = self.sessions.pop(key, None)
        if entries is None:
            return False
        self.free_slots.extend(e.slot for e in entries)
        return True

    def take_swaps(self) -> list[tuple[str, int, int]]:
        swaps, self.swaps = self.swaps, []
        return swaps

    def _drop_oldest(self) -> None:
        _, entries = self.sessions.popitem(last=False)
        self.free_slots.extend(e.slot for e in entries)
        self.num_drops += 1
