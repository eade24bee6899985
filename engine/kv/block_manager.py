"""The KV block pool: reference-counted blocks, salted hash-chained prefix cache, pins.

Plain Python over integers; the runner alone maps block ids onto tensors.
A block's hash covers (parent hash, its token ids, salt) where salt is
(tenant_id, adapter_id, cache_salt), so tenants and adapters never share
cache. A hit is confirmed against the stored token ids, salt and parent, so
a hash collision can never return a wrong block. Blocks are registered in
the cache only once their K/V have been computed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplex.engine.kv.pin_ledger import PinLedger

if TYPE_CHECKING:
    from loraplex.engine.kv.events import KVCacheListener
    from loraplex.engine.kv.host_tier import HostTier
    from loraplex.engine.sequence import Sequence

NO_PARENT = b""
# What keeps one tenant's cached prefix from another's: (tenant, adapter, the request's extra salt); () in tests
CacheSalt = tuple[str | None, ...]


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    parent_hash: bytes = NO_PARENT
    salt: CacheSalt = ()
    token_ids: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = None
        self.parent_hash = NO_PARENT
        self.salt = ()
        self.token_ids = []


def block_hash(parent_hash: bytes, token_ids: list[int], salt: CacheSalt) -> bytes:
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    digest.update(repr(salt).encode())
    return digest.digest()


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
        max_pinned_blocks: int | None = None, max_pinned_blocks_per_tenant: int | float | None = None,
        host_tier: HostTier | None = None, listener: KVCacheListener | None = None,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # LRU: ref_count 0 but hashed
        self.hash_to_block_id: dict[bytes, int] = {}
        self.pins: OrderedDict[str, list[int]] = OrderedDict()  # least recently used first
        self.pin_ledger = PinLedger()
        self.max_pinned_blocks = max_pinned_blocks                        # None: the pool is the limit
        # None: no per-tenant limit; a float: that share of the pool (what one tenant's sessions may pin)
        self.max_pinned_blocks_per_tenant = (max(1, int(num_blocks * max_pinned_blocks_per_tenant))
                                             if isinstance(max_pinned_blocks_per_tenant, float)
                                             else max_pinned_blocks_per_tenant)
        self.num_pins_evicted = 0
        self.num_pins_over_budget = 0  # sessions not pinned because they alone exceed a budget
        self.host_tier = host_tier  # pinned session KV offloaded to host memory; None: no host KV budget
        self.num_prefix_queries = 0  # prompt tokens looked up in the cache
        self.num_prefix_hits = 0     # of those, tokens found
        self.listener = listener  # told of blocks entering and leaving the prefix cache (engine/kv/events.py)

    # ---- counters -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks available for allocation (truly free + cached but unreferenced)."""
        return len(self.free_block_ids) + len(self.cached_free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_free)

    @property
    def num_pinned_blocks(self) -> int:
        return self.pin_ledger.num_blocks

    def pinned_blocks_by_tenant(self) -> dict[str, int]:
        return self.pin_ledger.by_tenant()

    # ---- allocation -----------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def allocate(self, seq: Sequence) -> None:
        """Attach the longest cached prefix of `seq` (whole blocks) and set its computed tokens.

        The last prompt token is always recomputed so the step yields its logits.
        """
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return  # prompt logprobs need every prompt token computed
        num_lookup = (len(seq.token_ids) - 1) // self.block_size
        parent = NO_PARENT
        for i in range(num_lookup):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            h = block_hash(parent, tokens, seq.salt)
            block_id = self.hash_to_block_id.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.salt != seq.salt or block.parent_hash != parent:
                break
            if block.ref_count == 0:
                self.cached_free.pop(block_id, None)
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            parent = h
        seq.num_computed_tokens = len(seq.block_table) * self.block_size

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        needed += self._needs_copy_on_write(seq)
        return needed <= self.num_free_blocks

    def may_append(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Give `seq` blocks for its next `num_new_tokens`; returns (src, dst) block copies to make."""
        copies: list[tuple[int, int]] = []
        if self._needs_copy_on_write(seq):
            src = seq.block_table[-1]
            dst = self._take_free_block()
            self.blocks[src].ref_count -= 1
            seq.block_table[-1] = dst
            copies.append((src, dst))
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return copies

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        """A partly filled last block shared with a fork must be copied before writing into it."""
        if not seq.block_table or seq.num_computed_tokens % self.block_size == 0:
            return False
        if seq.num_computed_tokens > len(seq.block_table) * self.block_size:
            return False
        last = seq.num_computed_tokens // self.block_size
        return last < len(seq.block_table) and self.blocks[seq.block_table[last]].ref_count > 1

    def _take_free_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            block_id, _ = self.cached_free.popitem(last=False)
            old = self.blocks[block_id]
            if old.hash is not None and self.hash_to_block_id.get(old.hash) == block_id:
                del self.hash_to_block_id[old.hash]
                if self.listener is not None:
                    self.listener.block_removed(old.hash)
        self.blocks[block_id].reset()
        return block_id

    def cache_blocks(self, seq: Sequence) -> None:
        """Register every full block whose K/V are now computed (call after each step)."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else NO_PARENT
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            h = block_hash(parent, tokens, seq.salt)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block_id:
                block.hash, block.parent_hash, block.salt, block.token_ids = h, parent, seq.salt, tokens
                self.hash_to_block_id[h] = block.block_id
                if self.listener is not None:
                    self.listener.block_stored(h, parent, tokens, seq.salt)

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def free_blocks_past(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks `seq` holds past its first `num_tokens` tokens (rejected draft tokens' K/V)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            self.cached_free[block_id] = None
        else:
            block.hash = None
            self.free_block_ids.append(block_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares all of `parent`'s blocks (copy-on-write for the partial last one)."""
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        for block_id in child.block_table:
            self.blocks[block_id].ref_count += 1

    # ---- sessions -------------------------------------------------------------------------
    def pin(self, key: str, seq: Sequence) -> int:
        """Keep `seq`'s cached full blocks alive under `key`, replacing an earlier pin of that key.

        Returns the number of tokens pinned (0 when the session alone exceeds a pin
        budget: it is not pinned and its next turn re-prefills). The new blocks are
        referenced before the old pin is dropped, so blocks the two share never
        become evictable. Other pins are offloaded, least recently used first, until
        the tenant's and the global budget hold this one.
        """
        self.cache_blocks(seq)
        block_ids = [b for b, _ in zip(seq.block_table, seq.block_hashes, strict=False)]
        for block_id in block_ids:
            self.blocks[block_id].ref_count += 1
        self.unpin(key)
        if self.host_tier is not None:
            self.host_tier.discard(key)  # the device copy is newer
        if not self._fit_pin_budgets(seq.tenant_id, block_ids):
            for block_id in reversed(block_ids):
                self._release(block_id)
            return 0
        self._add_pin(key, seq.tenant_id, block_ids)
        return len(block_ids) * self.block_size

    def restore_pin(self, key: str, tenant_id: str) -> bool:
        """Pin again a session whose blocks were offloaded to the host tier (copies run next step).

        A session already pinned on the device becomes the most recently used.
        """
        if key in self.pins:
            self.pins.move_to_end(key)
            return False
        if self.host_tier is None:
            return False
        block_ids = self.host_tier.restore(key, self)
        if block_ids is None:
            return False
        if not self._fit_pin_budgets(tenant_id, block_ids):
            for block_id in reversed(block_ids):
                self._release(block_id)
            return False
        self._add_pin(key, tenant_id, block_ids)
        return True

    def _fit_pin_budgets(self, tenant_id: str, block_ids: list[int]) -> bool:
        """Offload LRU pins (the tenant's, then anyone's) until `block_ids` fit; False if they never can."""
        tenant_cap, global_cap = self.max_pinned_blocks_per_tenant, self.max_pinned_blocks
        distinct = len(set(block_ids))
        if (tenant_cap is not None and distinct > tenant_cap) or (global_cap is not None and distinct > global_cap):
            self.num_pins_over_budget += 1
            return False
        ledger = self.pin_ledger
        if tenant_cap is not None:
            while ledger.num_blocks_of(tenant_id) + ledger.num_new_for(tenant_id, block_ids)[0] > tenant_cap:
                self._evict_pin(next(k for k in self.pins if ledger.tenant_of[k] == tenant_id))
        if global_cap is not None:
            while ledger.num_blocks + ledger.num_new_for(tenant_id, block_ids)[1] > global_cap:
                self._evict_pin(next(iter(self.pins)))
        return True

    def _add_pin(self, key: str, tenant_id: str, block_ids: list[int]) -> None:
        self.pins[key] = block_ids
        self.pin_ledger.add(key, tenant_id, block_ids)

    def cached_block(self, h: bytes, token_ids: list[int], salt: CacheSalt, parent: bytes) -> int | None:
        """The device block holding exactly this cached content, if it is still there."""
        block_id = self.hash_to_block_id.get(h)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != token_ids or block.salt != salt or block.parent_hash != parent:
            return None
        return block_id

    def take_ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.cached_free.pop(block_id, None)
        block.ref_count += 1

    def release_ref(self, block_id: int) -> None:
        self._release(block_id)

    def take_block_for(self, h: bytes, token_ids: list[int], salt: CacheSalt, parent: bytes) -> int:
        """A free block registered in the prefix cache as holding this content (its K/V are copied in)."""
        block_id = self._take_free_block()
        block = self.blocks[block_id]
        block.hash, block.parent_hash, block.salt, block.token_ids = h, parent, salt, list(token_ids)
        self.hash_to_block_id[h] = block_id
        if self.listener is not None:
            self.listener.block_stored(h, parent, block.token_ids, salt)
        return block_id

    def evict_oldest_pin(self) -> str | None:
        """Drop the oldest pin to make room, offloading it to the host tier if there is one; None if none."""
        if not self.pins:
            return None
        key = next(iter(self.pins))
        self._evict_pin(key)
        return key

    def _evict_pin(self, key: str) -> None:
        if self.host_tier is not None:
            self.host_tier.offload(key, [self.blocks[b] for b in self.pins[key]])
        self.unpin(key)
        self.num_pins_evicted += 1

    def unpin(self, key: str) -> bool:
        block_ids = self.pins.pop(key, None)
        if block_ids is None:
            return False
        self.pin_ledger.remove(key, block_ids)
        for block_id in reversed(block_ids):
            self._release(block_id)
        return True
