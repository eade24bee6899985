"""The block pool over plain integers: prefix hits, salts, LRU, copy-on-write forks, pins."""

from __future__ import annotations

from loraplex.engine.kv.block_manager import BlockManager
from loraplex.engine.protocol import SamplingParams
from loraplex.engine.sequence import Sequence

BS = 4


def seq(tokens: list[int], salt: tuple = ("t", None, "")) -> Sequence:
    return Sequence("r", 0, tokens, SamplingParams(), salt[0], salt[1], salt, 0.0)


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    """What the scheduler + runner do for a whole prompt: allocate, append, compute, cache."""
    bm.allocate(s)
    bm.may_append(s, s.num_uncomputed_tokens)
    s.num_computed_tokens = len(s.token_ids)
    bm.cache_blocks(s)


def test_prefix_hit_reuses_computed_blocks_and_keeps_last_token_uncomputed():
    bm = BlockManager(16, BS)
    a = seq(list(range(10)))  # 2 full blocks + 2 tokens
    run_prefill(bm, a)
    b = seq([*list(range(10)), 99])
    bm.allocate(b)
    assert b.block_table == a.block_table[:2]
    assert b.num_computed_tokens == 8
    exact = seq(list(range(8)))  # the whole prompt cached: its last block is recomputed
    bm.allocate(exact)
    assert exact.num_computed_tokens == 4


def test_blocks_are_cached_only_once_computed():
    bm = BlockManager(16, BS)
    a = seq(list(range(12)))
    bm.allocate(a)
    bm.may_append(a, 12)
    a.num_computed_tokens = 4  # first chunk only
    bm.cache_blocks(a)
    b = seq(list(range(12)))
    bm.allocate(b)
    assert b.num_computed_tokens == 4


def test_different_salts_never_share():
    bm = BlockManager(16, BS)
    tokens = list(range(13))
    run_prefill(bm, seq(tokens, ("tenant-a", None, "")))
    for salt in [("tenant-b", None, ""), ("tenant-a", "adapter-1", ""), ("tenant-a", None, "x")]:
        other = seq(tokens, salt)
        bm.allocate(other)
        assert other.num_computed_tokens == 0, salt
        bm.deallocate(other)


def test_freed_blocks_stay_cached_in_lru_until_evicted():
    bm = BlockManager(4, BS)
    a = seq(list(range(8)))
    run_prefill(bm, a)
    bm.deallocate(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    b = seq([*list(range(8)), 1])
    bm.allocate(b)
    assert b.num_computed_tokens == 8
    bm.deallocate(b)
    # Fill the pool with unrelated tokens: the cached blocks are evicted (oldest first).
    c = seq(list(range(100, 116)))
    run_prefill(bm, c)
    assert bm.num_free_blocks == 0
    bm.deallocate(c)
    d = seq([*list(range(8)), 1])
    bm.allocate(d)
    assert d.num_computed_tokens == 0


def test_hash_hit_is_checked_against_stored_tokens():
    bm = BlockManager(8, BS)
    a = seq([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    block = bm.blocks[a.block_table[0]]
    block.token_ids = [9, 9, 9, 9]  # simulate a colliding hash holding other tokens
    b = seq([1, 2, 3, 4, 5])
    bm.allocate(b)
    assert b.num_computed_tokens == 0


def test_can_append_counts_free_and_evictable_blocks():
    bm = BlockManager(3, BS)
    a = seq(list(range(9)))
    bm.allocate(a)
    assert bm.can_append(a, 9)
    assert not bm.can_append(a, 13)


def test_fork_shares_blocks_and_copies_partial_last_block_on_write():
    bm = BlockManager(8, BS)
    parent = seq(list(range(6)))
    run_prefill(bm, parent)
    child = seq(list(range(6)))
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert bm.blocks[parent.block_table[1]].ref_count == 2
    parent.token_ids.append(50)
    child.token_ids.append(60)
    copies = bm.may_append(child, 1)
    assert len(copies) == 1 and copies[0][0] == parent.block_table[1]
    assert child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] != parent.block_table[1]
    assert bm.may_append(parent, 1) == []  # now the only owner: writes in place
    bm.deallocate(parent)
    bm.deallocate(child)
    assert bm.num_free_blocks == 8


def test_pin_keeps_blocks_until_unpinned_and_replacement_keeps_shared_blocks():
    bm = BlockManager(8, BS)
    turn1 = seq(list(range(9)))
    run_prefill(bm, turn1)
    assert bm.pin("s1", turn1) == 8
    bm.deallocate(turn1)
    assert bm.num_pinned_blocks == 2
    assert bm.num_free_blocks == 6  # pinned blocks are not evictable
    turn2 = seq(list(range(9)) + list(range(20, 30)))
    bm.allocate(turn2)
    assert turn2.num_computed_tokens == 8
    bm.may_append(turn2, turn2.num_uncomputed_tokens)
    turn2.num_computed_tokens = len(turn2.token_ids)
    bm.pin("s1", turn2)  # replaces the old pin; the shared prefix never became free
    bm.deallocate(turn2)
    assert bm.num_pinned_blocks == 4
    assert bm.unpin("s1")
    assert not bm.unpin("s1")
    assert bm.num_pinned_blocks == 0 and bm.num_free_blocks == 8


def pinned_turn(bm: BlockManager, key: str, tokens: list[int], tenant: str) -> int:
    """One finished session turn of `tenant`: prefill, pin, free the sequence; returns tokens pinned."""
    s = seq(tokens, (tenant, None, ""))
    run_prefill(bm, s)
    pinned = bm.pin(key, s)
    bm.deallocate(s)
    return pinned


def test_shared_prefix_blocks_count_once_per_tenant():
    bm = BlockManager(16, BS)
    pinned_turn(bm, "a1", list(range(9)), "A")
    pinned_turn(bm, "a2", [*range(8), 50, 51, 52, 53, 54], "A")  # shares the first 2 blocks with a1
    assert bm.pinned_blocks_by_tenant() == {"A": 3} and bm.num_pinned_blocks == 3
    bm.unpin("a1")
    assert bm.pinned_blocks_by_tenant() == {"A": 3}  # a2 still holds all three
    bm.unpin("a2")
    assert bm.pinned_blocks_by_tenant() == {} and bm.num_pinned_blocks == 0 and bm.num_free_blocks == 16


def test_tenant_budget_evicts_that_tenants_oldest_pins_only():
    bm = BlockManager(32, BS, max_pinned_blocks_per_tenant=4)
    pinned_turn(bm, "b1", list(range(100, 109)), "B")          # 2 blocks
    pinned_turn(bm, "a1", list(range(9)), "A")                 # 2 blocks
    pinned_turn(bm, "a2", list(range(20, 29)), "A")            # 2 blocks: A at its budget
    assert bm.pinned_blocks_by_tenant() == {"A": 4, "B": 2}
    pinned_turn(bm, "a3", list(range(40, 49)), "A")            # evicts a1 (A's oldest), never b1
    assert list(bm.pins) == ["b1", "a2", "a3"]
    assert bm.pinned_blocks_by_tenant() == {"A": 4, "B": 2} and bm.num_pins_evicted == 1
    bm.restore_pin("a2", "A")                                  # a turn of a2 makes it the most recent
    pinned_turn(bm, "a4", list(range(60, 69)), "A")            # so a3 goes
    assert list(bm.pins) == ["b1", "a2", "a4"]


def test_global_budget_evicts_least_recently_used_across_tenants():
    bm = BlockManager(32, BS, max_pinned_blocks=6)
    pinned_turn(bm, "a1", list(range(9)), "A")
    pinned_turn(bm, "b1", list(range(100, 109)), "B")
    pinned_turn(bm, "a2", list(range(20, 29)), "A")
    pinned_turn(bm, "b2", list(range(120, 129)), "B")          # 8 > 6: a1, the LRU of anyone, goes
    assert list(bm.pins) == ["b1", "a2", "b2"] and bm.num_pinned_blocks == 6
    pinned_turn(bm, "a3", list(range(40, 49)), "A")            # then b1
    assert list(bm.pins) == ["a2", "b2", "a3"]
    assert bm.pinned_blocks_by_tenant() == {"A": 4, "B": 2}


def test_session_larger_than_a_budget_is_not_pinned_and_frees_its_old_pin():
    bm = BlockManager(32, BS, max_pinned_blocks_per_tenant=3)
    assert pinned_turn(bm, "a1", list(range(9)), "A") == 8
    assert pinned_turn(bm, "a1", list(range(17)), "A") == 0   # 4 blocks alone exceed 3
    assert "a1" not in bm.pins and bm.num_pins_over_budget == 1
    assert bm.num_pinned_blocks == 0 and bm.num_free_blocks == 32


def test_pins_of_no_full_block_keep_the_counts_exact():
    bm = BlockManager(8, BS)
    pinned_turn(bm, "short", [1, 2, 3], "A")   # under one block: pins nothing
    pinned_turn(bm, "long", list(range(9)), "A")
    bm.unpin("long")
    assert bm.unpin("short")
    assert bm.pinned_blocks_by_tenant() == {} and bm.num_free_blocks == 8
