"""A preempted sequence's computed blocks parked in the host tier, and brought back when it resumes.

Only whole blocks already in the prefix cache's chain travel (the partly filled
last one is recomputed): on the way back they re-enter the prefix cache, so the
resumed sequence's `allocate` finds them like any cached prefix. When the host
tier has no free room the sequence recomputes instead (its blocks stay in the
device prefix cache until something needs them).
"""

from __future__ import annotations

from loraplex.engine.kv.block_manager import NO_PARENT, BlockManager
from loraplex.engine.sequence import Sequence


def swap_key(seq: Sequence) -> str:
    return f"\x00preempted:{seq.seq_id}"  # never a session key: those come from the API as text ids


def swap_out(block_manager: BlockManager, seq: Sequence) -> bool:
    """Record the copy of `seq`'s cached blocks to host slots (before they are freed); False if no room."""
    tier = block_manager.host_tier
    num_full = len(seq.block_hashes)
    if tier is None or num_full == 0:
        return False
    size = block_manager.block_size
    blocks = []
    for i in range(num_full):
        parent = seq.block_hashes[i - 1] if i else NO_PARENT
        blocks.append((seq.block_table[i], seq.block_hashes[i], parent, seq.salt,
                       seq.token_ids[i * size:(i + 1) * size]))
    return tier.offload_if_room(swap_key(seq), blocks)


def swap_in(block_manager: BlockManager, seq: Sequence) -> None:
    """Allocate `seq` again, first bringing its parked blocks back into the prefix cache (if the device has room
    for them now; otherwise it recomputes what is missing)."""
    tier = block_manager.host_tier
    restored = tier.restore(swap_key(seq), block_manager) if tier is not None else None
    if tier is not None and restored is None:
        tier.discard(swap_key(seq))
    block_manager.allocate(seq)
    for block_id in restored or []:
        block_manager.release_ref(block_id)  # allocate took its own reference


def discard(block_manager: BlockManager, seq: Sequence) -> None:
    if block_manager.host_tier is not None:
        block_manager.host_tier.discard(swap_key(seq))
