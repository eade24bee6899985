"""A tenant's share of grammar compilation: at most `max_per_tenant` compilations in flight per tenant.

The compile pool has a few threads for every tenant of the process. Without
a share, one tenant sending distinct slow schemas fills every thread and
everyone else's `response_format` waits behind them. A request whose tenant
is at its cap waits for one of its own compilations to finish, at most
`wait_s`; then it gets 429 `tenant_compile_limit`. A schema this process has
already compiled is served from the compiler's cache and needs no slot.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from loraplex.grammar.spec import GrammarSpec
from loraplex.platform.errors import RateLimitedError

_MAX_KNOWN = 4096  # compiled specs remembered as cache hits (the compiler's own cache is smaller)


class TenantCompileLimitError(RateLimitedError):
    def __init__(self, limit: int, wait_s: float) -> None:
        super().__init__(
            f"this tenant already has {limit} grammar compilation(s) running (grammar_compiles_per_tenant) and "
            f"none finished within {wait_s:g}s; retry when one finishes, or reuse a schema already compiled",
            retry_after_s=max(1, round(wait_s)), code="tenant_compile_limit",
        )


class TenantCompileSlots:
    """Per API process; `max_per_tenant=0` turns the cap off."""

    def __init__(self, max_per_tenant: int, wait_s: float) -> None:
        self.max_per_tenant = max_per_tenant
        self.wait_s = wait_s
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._num_holders: dict[str, int] = {}
        self._compiled: OrderedDict[str, None] = OrderedDict()

    def num_in_flight(self, tenant_id: str) -> int:
        return self._num_holders.get(tenant_id, 0)

    @asynccontextmanager
    async def hold(self, tenant_id: str, spec: GrammarSpec) -> AsyncIterator[None]:
        key = spec.cache_key()
        if not self.max_per_tenant or key in self._compiled:
            yield
            return
        slot = self._slots.setdefault(tenant_id, asyncio.Semaphore(self.max_per_tenant))
        self._num_holders[tenant_id] = self._num_holders.get(tenant_id, 0) + 1  # waiters too: keeps `slot`
        try:
            try:
                await asyncio.wait_for(slot.acquire(), timeout=self.wait_s)
            except TimeoutError:
                raise TenantCompileLimitError(self.max_per_tenant, self.wait_s) from None
            try:
                yield
                self._remember(key)
            finally:
                slot.release()
        finally:
            self._num_holders[tenant_id] -= 1
            if not self._num_holders[tenant_id]:
                del self._num_holders[tenant_id], self._slots[tenant_id]

    def _remember(self, key: str) -> None:
        self._compiled[key] = None
        self._compiled.move_to_end(key)
        while len(self._compiled) > _MAX_KNOWN:
            self._compiled.popitem(last=False)
