"""Weighted fair shares of the engine between tenants: who is over its share, who runs next, who yields.

Plain Python over counts; the scheduler asks, it never touches a tensor.

A tenant's share of a resource (running slots, KV blocks, a step's prefill
tokens) is the resource times its weight over the weights of the tenants
that want it now: work-conserving, since an idle tenant counts for nothing
and its share goes to the busy ones. Batch work (`background`) has no share
while interactive work waits: it runs on what interactive work leaves, and
is preempted first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from loraplex.engine.sequence import Sequence

DEFAULT_WEIGHT = 1.0
PROTECT_STEPS = 32  # a sequence resumed after a fairness preemption is not preempted for fairness again this long


def admission_key(seq: Sequence) -> tuple[bool, int, float]:
    """Within one tenant: interactive before batch, then the request's priority (lower first), then arrival."""
    return (seq.background, seq.priority, seq.arrival_time)


@dataclass(slots=True)
class TenantLoad:
    num_running: int = 0
    num_blocks: int = 0          # KV blocks of its running sequences plus its pinned session blocks
    num_background: int = 0      # of num_running, batch sequences


@dataclass(slots=True)
class FairShare:
    weights: dict[str, float] = field(default_factory=dict)

    def set_weight(self, tenant_id: str, weight: float) -> None:
        self.weights[tenant_id] = weight if weight > 0 else DEFAULT_WEIGHT

    def weight(self, tenant_id: str) -> float:
        return self.weights.get(tenant_id, DEFAULT_WEIGHT)

    def shares(self, tenant_ids: Iterable[str], capacity: float) -> dict[str, float]:
        """`capacity` split by weight among `tenant_ids` (the tenants that want it now)."""
        tenants = list(dict.fromkeys(tenant_ids))
        total = sum(self.weight(t) for t in tenants)
        if not tenants or total <= 0:
            return {}
        return {t: capacity * self.weight(t) / total for t in tenants}

    def forget(self, live_tenant_ids: set[str]) -> None:
        """Drop the weights of tenants with nothing queued or running (weights come again with each request)."""
        for tenant in [t for t in self.weights if t not in live_tenant_ids]:
            del self.weights[tenant]


def loads(running: list[Sequence], pinned_blocks_by_tenant: dict[str, int]) -> dict[str, TenantLoad]:
    by_tenant: dict[str, TenantLoad] = {}
    for seq in running:
        load = by_tenant.setdefault(seq.tenant_id, TenantLoad())
        load.num_running += 1
        load.num_blocks += len(seq.block_table)
        load.num_background += seq.background
    for tenant, num_pinned in pinned_blocks_by_tenant.items():
        by_tenant.setdefault(tenant, TenantLoad()).num_blocks += num_pinned
    return by_tenant


def flooding_tenants(counts: dict[str, int], min_seqs: int, ratio: float) -> set[str]:
    """Tenants running at least `min_seqs` sequences and `ratio` times as many as the tenant with the fewest
    (`counts`: sequences per tenant, running or waiting); none while only one tenant has work."""
    if len(counts) < 2:
        return set()
    flooding = set()
    for tenant, count in counts.items():
        fewest_other = min(c for t, c in counts.items() if t != tenant)
        if count >= min_seqs and count >= ratio * fewest_other:
            flooding.add(tenant)
    return flooding


def pick_victim(running: list[Sequence], candidate: Sequence, load: dict[str, TenantLoad],
                slot_share: dict[str, float], block_share: dict[str, float], by_blocks: bool,
                step: int) -> Sequence | None:
    """The sequence to preempt so `candidate` can run, or None when it must wait.

    Batch sequences go first, the newest first (for any interactive candidate). Otherwise the newest
    unprotected sequence of the tenant furthest over its share (slots, or blocks when blocks are short),
    and only when that tenant is over its share and the candidate's tenant is under its own.
    """
    if candidate.background:
        return None  # batch work never preempts anything
    batch = [s for s in running if s.background and s.protected_until <= step and s.parent is None]
    if batch:
        return max(batch, key=lambda s: s.arrival_time)
    share = block_share if by_blocks else slot_share

    def used(tenant: str) -> float:
        tenant_load = load.get(tenant, TenantLoad())
        return tenant_load.num_blocks if by_blocks else tenant_load.num_running

    mine = candidate.tenant_id
    if used(mine) >= share.get(mine, 0.0):
        return None
    over = sorted(((used(t) / share[t], t) for t in load if t != mine and t in share and used(t) > share[t]),
                  reverse=True)
    for _, tenant in over:
        victims = [s for s in running if s.tenant_id == tenant and s.protected_until <= step and s.parent is None]
        if victims:
            return max(victims, key=lambda s: (s.priority, s.arrival_time))
    return None


def prefill_caps(budget: int, demand: dict[str, int], fair: FairShare, min_chunk: int) -> dict[str, int]:
    """Each tenant's cap on prefill tokens this step: its weighted share of `budget` among the tenants with
    prefill demand, what one tenant cannot use going to the others (at least `min_chunk` each, so a small
    share still makes progress)."""
    caps: dict[str, int] = {}
    remaining, open_tenants = budget, dict(demand)
    while open_tenants and remaining > 0:
        shares = fair.shares(open_tenants, remaining)
        settled = {t: d for t, d in open_tenants.items() if d <= shares[t]}
        if not settled:
            for tenant, share in shares.items():
                caps[tenant] = caps.get(tenant, 0) + max(int(share), min(min_chunk, open_tenants[tenant]))
            break
        for tenant, wanted in settled.items():
            caps[tenant] = caps.get(tenant, 0) + wanted
            remaining -= wanted
            del open_tenants[tenant]
    return caps
