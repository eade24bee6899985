"""Exact counts of pinned device blocks, globally and per tenant, for the session pin budgets.

A block held by several pins (sessions sharing a prefix) counts once per tenant
and once globally: each tenant keeps a multiplicity per block, and the count is
the number of distinct blocks. Plain ints, updated as pins come and go.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping


class PinLedger:
    def __init__(self) -> None:
        self.tenant_of: dict[str, str] = {}                # pin key -> tenant
        self._by_tenant: dict[str, Counter[int]] = {}      # tenant -> block id -> pins of that tenant holding it
        self._global: Counter[int] = Counter()             # block id -> pins holding it

    @property
    def num_blocks(self) -> int:
        return len(self._global)

    def num_blocks_of(self, tenant: str) -> int:
        held = self._by_tenant.get(tenant)
        return len(held) if held else 0

    def by_tenant(self) -> dict[str, int]:
        return {tenant: len(held) for tenant, held in self._by_tenant.items()}

    def num_new_for(self, tenant: str, block_ids: list[int]) -> tuple[int, int]:
        """How many of `block_ids` the tenant's count and the global count would grow by."""
        held: Mapping[int, int] = self._by_tenant.get(tenant, {})
        distinct = set(block_ids)
        return sum(b not in held for b in distinct), sum(b not in self._global for b in distinct)

    def add(self, key: str, tenant: str, block_ids: list[int]) -> None:
        self.tenant_of[key] = tenant
        if not block_ids:
            return  # a pin of no full block (a short prompt) holds nothing to count
        held = self._by_tenant.setdefault(tenant, Counter())
        for block_id in set(block_ids):
            held[block_id] += 1
            self._global[block_id] += 1

    def remove(self, key: str, block_ids: list[int]) -> None:
        tenant = self.tenant_of.pop(key)
        if not block_ids:
            return
        held = self._by_tenant[tenant]
        for block_id in set(block_ids):
            _decrement(held, block_id)
            _decrement(self._global, block_id)
        if not held:
            del self._by_tenant[tenant]


def _decrement(counts: Counter[int], block_id: int) -> None:
    counts[block_id] -= 1
    if counts[block_id] <= 0:
        del counts[block_id]
