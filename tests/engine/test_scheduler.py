"""Scheduling decisions over plain integers (no model): budget, chunking, preemption, fairness."""

from __future__ import annotations

import itertools

from loraplex.engine.kv.block_manager import BlockManager
from loraplex.engine.protocol import SamplingParams
from loraplex.engine.scheduler import Scheduler, SchedulerOutput
from loraplex.engine.sequence import Sequence

_arrival = itertools.count()


def seq(n_prompt: int, tenant: str = "t", adapter: str | None = None, first: int = 0) -> Sequence:
    tokens = list(range(first, first + n_prompt))
    return Sequence(f"r{next(_arrival)}", 0, tokens, SamplingParams(), tenant, adapter, (tenant, adapter, ""),
                    float(next(_arrival)))


def complete(sched: Scheduler, out: SchedulerOutput) -> None:
    """Stand-in for the runner + engine: the scheduler takes the step's progress (as the engine has it do after
    every step: forked children become sequences of their own), then token 7 is sampled where due."""
    sched.update_from_output(out)
    for s in out.seqs:
        sched.block_manager.cache_blocks(s)
        if s.num_computed_tokens == len(s.token_ids):
            s.token_ids.append(7)


def test_long_prompt_is_chunked_and_never_stalls_decodes():
    bm = BlockManager(200, 16)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    short = seq(10)
    sched.add(short)
    complete(sched, sched.schedule())  # short prefilled, now decoding
    long = seq(300)
    sched.add(long)
    for _ in range(4):  # 4 chunks of 63 (the decode takes 1 of the 64), then the last 48
        out = sched.schedule()
        assert short in out.seqs and out.num_new_tokens[out.seqs.index(short)] == 1
        assert sum(out.num_new_tokens) <= 64
        assert out.num_new_tokens[out.seqs.index(long)] == 63
        complete(sched, out)


def test_preemption_takes_the_newest_and_it_resumes_later():
    bm = BlockManager(6, 4)  # 24 token slots
    sched = Scheduler(bm, max_num_batched_tokens=100, max_num_seqs=8)
    old, new = seq(8), seq(8, first=100)
    sched.add(old)
    sched.add(new)
    complete(sched, sched.schedule())
    preempted_seen = False
    for _ in range(40):
        out = sched.schedule()
        if out.num_preempted:
            preempted_seen = True
            assert new not in sched.running and old in sched.running
        complete(sched, out)
        if len(old.token_ids) >= 20:
            break
    assert preempted_seen and sched.num_preemptions >= 1
    sched.finish(old)
    out = sched.schedule()
    assert new in out.seqs  # resumed: recomputes its prompt and the tokens it already had
    assert out.num_new_tokens[out.seqs.index(new)] == len(new.token_ids) - new.num_computed_tokens


def test_tenant_with_least_recent_service_is_admitted_first():
    bm = BlockManager(1000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=4)
    flood = [seq(20, tenant="A", first=i * 100) for i in range(200)]
    for s in flood:
        sched.add(s)
    complete(sched, sched.schedule())
    complete(sched, sched.schedule())
    lone = seq(20, tenant="B", first=50_000)
    sched.add(lone)
    started_at = None
    for step in range(10):
        out = sched.schedule()
        if lone in out.seqs:
            started_at = step
            break
        complete(sched, out)
        sched.finish(sched.running[0])  # A's requests finish one by one, freeing slots
    assert started_at is not None and started_at <= 2


def test_request_whose_adapter_is_not_ready_waits_without_blocking_others():
    bm = BlockManager(100, 16)
    ready = {"good"}
    sched = Scheduler(bm, 256, 8, adapter_ready=lambda a: a in ready)
    blocked = seq(10, adapter="cold")
    fine = seq(10, adapter="good", first=500)
    base = seq(10, first=900)
    for s in (blocked, fine, base):
        sched.add(s)
    out = sched.schedule()
    assert blocked not in out.seqs and fine in out.seqs and base in out.seqs
    ready.add("cold")
    assert blocked in sched.schedule().seqs


def test_fork_children_join_when_the_parent_prefill_completes():
    bm = BlockManager(100, 4)
    sched = Scheduler(bm, 256, 8)
    parent = seq(10)
    children = [Sequence(parent.request_id, i, parent.token_ids, parent.sampling, "t", None, parent.salt, 0.0)
                for i in (1, 2)]
    sched.add(parent, children)
    out = sched.schedule()
    assert out.seqs == [parent, *children] and out.num_new_tokens == [10, 0, 0]
    assert all(c.block_table == parent.block_table for c in children)
    for c in children:
        assert c.parent is parent and c.num_computed_tokens == 10


def with_choices(parent: Sequence, n: int) -> list[Sequence]:
    return [Sequence(parent.request_id, i, parent.token_ids, parent.sampling, parent.tenant_id, None, parent.salt,
                     0.0) for i in range(1, n)]


def test_a_requests_choices_hold_their_slots_from_admission_and_never_run_past_the_slots():
    """A request of n choices takes n slots when admitted (its parent alone runs until its prompt is computed):
    admitted into fewer free slots, its forks made steps of more rows than the engine runs. While it waits for
    room, its own tenant's later request does not take the slots that free; then it runs with all its choices."""
    bm = BlockManager(400, 4)
    sched = Scheduler(bm, max_num_batched_tokens=16, max_num_seqs=8)
    running = [seq(3) for _ in range(6)]
    for s in running:
        sched.add(s)
    complete(sched, sched.schedule())
    wide = seq(40)  # 3 chunks of prefill, then 3 forks
    sched.add(wide, with_choices(wide, 4))
    late = seq(3)
    sched.add(late)
    out = sched.schedule()
    assert wide not in out.seqs and late not in out.seqs  # 6 taken + 4 > 8: it waits, and so does the one behind
    for s in running[:2]:
        sched.finish(s)
    largest = 0
    for _ in range(8):
        out = sched.schedule()
        largest = max(largest, len(out.seqs), len(sched.running))
        assert sched.num_slots_taken() <= 8
        complete(sched, out)
    assert wide in sched.running and len([s for s in sched.running if s.request_id == wide.request_id]) == 4
    assert late not in sched.running and largest == 8  # 4 short ones and the 4 choices fill the slots


def test_another_tenants_forked_choices_are_preempted_like_any_sequence():
    """Tenant B's request of 8 choices fills the engine. Once forked, each choice is a sequence of its own, so
    tenant A's request of 4 choices and tenant C's single request get room by preempting B's choices (B is over
    its share), within two steps and never past the engine's slots."""
    bm = BlockManager(400, 4)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    flood = seq(3, tenant="b")
    sched.add(flood, with_choices(flood, 8))
    complete(sched, sched.schedule())
    assert len(sched.running) == 8
    wide, single = seq(5, tenant="a"), seq(5, tenant="c")
    sched.add(wide, with_choices(wide, 4))
    sched.add(single)
    for _ in range(2):
        complete(sched, sched.schedule())
        assert sched.num_slots_taken() <= 8
    running = {(s.tenant_id, s.index) for s in sched.running}
    assert {("a", i) for i in range(4)} <= running and ("c", 0) in running
    assert sum(1 for s in sched.running if s.tenant_id == "b") == 3
    assert any(s.index > 0 for s in sched.waiting_seqs() if s.tenant_id == "b")  # forked choices among those preempted


def test_a_wide_request_waiting_for_room_holds_back_tenants_over_their_share_but_not_one_under_it():
    """Tenant A's request of 8 choices needs the whole engine; preemption takes tenant B down to its share (2 of
    8 among three tenants) and no further, so A waits for room. While it waits, B (at its share) takes none of
    the slots that free, but tenant C's single request, under its share, does: A's wait is not C's."""
    bm = BlockManager(400, 4)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    for _ in range(6):
        sched.add(seq(3, tenant="b"))
    complete(sched, sched.schedule())
    wide, single = seq(5, tenant="a"), seq(5, tenant="c")
    sched.add(wide, with_choices(wide, 8))
    sched.add(single)
    for _ in range(3):
        complete(sched, sched.schedule())
        assert sched.num_slots_taken() <= 8
    assert single in sched.running and wide not in sched.running
    assert sum(1 for s in sched.running if s.tenant_id == "b") == 2
    assert sum(1 for s in sched.waiting_seqs() if s.tenant_id == "b") == 4  # kept out while A waits
    for s in list(sched.running):
        sched.finish(s)
    complete(sched, sched.schedule())
    assert len([s for s in sched.running if s.request_id == wide.request_id]) == 8  # then it runs whole


def run_steps(sched: Scheduler, bm: BlockManager, num_steps: int) -> dict[str, int]:
    """Steps in which each request was scheduled."""
    counts: dict[str, int] = {}
    for _ in range(num_steps):
        out = sched.schedule()
        for s in out.seqs:
            counts[s.request_id] = counts.get(s.request_id, 0) + 1
        complete(sched, out)
    return counts


def test_a_long_decode_yields_every_other_step_to_another_tenants_short_one():
    bm = BlockManager(400, 16)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8, decode_yield_min_tokens=16)
    long = seq(10, tenant="attacker")
    sched.add(long)
    run_steps(sched, bm, 40)  # 40 tokens generated alone: never yields to nobody
    assert long.num_output_tokens == 40
    short = seq(10, tenant="victim", first=500)
    sched.add(short)
    counts = run_steps(sched, bm, 10)
    assert counts[short.request_id] == 10  # the short request runs every step
    # The long one runs in one step of three (not in the one the short one is admitted in): slowed, never starved.
    assert counts[long.request_id] == 3
    assert sched.num_yielded_decodes == 7


def test_a_short_request_about_to_end_is_not_interrupted_but_a_stream_of_them_never_stops_the_long_one():
    bm = BlockManager(800, 16)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8, decode_yield_min_tokens=16)
    long = seq(10, tenant="attacker")
    sched.add(long)
    run_steps(sched, bm, 40)

    def short_request(max_tokens: int) -> tuple[int, int]:
        """(steps the short request took, steps the long decode ran meanwhile), finishing it at max_tokens."""
        short = seq(10, tenant="victim", first=500)
        short.sampling = SamplingParams(max_tokens=max_tokens)
        sched.add(short)
        steps = long_steps = 0
        while short.num_output_tokens < max_tokens:
            out = sched.schedule()
            steps += 1
            long_steps += long in out.seqs
            complete(sched, out)
        sched.finish(short)
        return steps, long_steps

    # A request ending within the long decode's yield period (3 steps here) runs alone to its end.
    assert short_request(2) == (2, 0)
    # A longer one still shares: the long decode runs one step in three of it (every step once the short one
    # is half as long).
    steps, long_steps = short_request(24)
    assert steps == 24 and long_steps >= 6
    # Short requests back to back: the long decode waits at most two periods at a time, so it keeps running.
    ran = sum(short_request(2)[1] for _ in range(30))
    assert ran >= 30 * 2 // 6 - 1


def test_no_yield_within_one_tenant_between_comparable_lengths_or_when_off():
    for min_tokens, tenants, expected in [(16, ("a", "a"), 10), (0, ("a", "b"), 10)]:
        bm = BlockManager(400, 16)
        sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8, decode_yield_min_tokens=min_tokens)
        long = seq(10, tenant=tenants[0])
        sched.add(long)
        run_steps(sched, bm, 40)
        sched.add(seq(10, tenant=tenants[1], first=500))
        assert run_steps(sched, bm, 10)[long.request_id] == expected
    bm = BlockManager(400, 16)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8, decode_yield_min_tokens=16)
    first, second = seq(10, tenant="a"), seq(10, tenant="b", first=500)
    sched.add(first)
    run_steps(sched, bm, 20)
    sched.add(second)
    run_steps(sched, bm, 30)  # the second catches up to more than half the first: both run every step
    assert run_steps(sched, bm, 6) == {first.request_id: 6, second.request_id: 6}


def test_update_from_output_owns_token_progress():
    bm = BlockManager(50, 16)
    sched = Scheduler(bm, max_num_batched_tokens=16, max_num_seqs=8)
    long = seq(40)
    sched.add(long)
    for want in (16, 32, 40):  # chunked prefill: each step's tokens count once the step ran
        out = sched.schedule()
        assert long.num_computed_tokens == want - out.num_new_tokens[0]
        sched.update_from_output(out)
        assert long.num_computed_tokens == want
