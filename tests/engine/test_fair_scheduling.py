"""Fair sharing between tenants in the scheduler, over plain integers (no model)."""

from __future__ import annotations

import itertools

import pytest
from loraplex.engine import fair_share
from loraplex.engine.fair_share import FairShare
from loraplex.engine.kv.block_manager import BlockManager
from loraplex.engine.kv.host_tier import TO_DEVICE, TO_HOST, HostTier
from loraplex.engine.protocol import SamplingParams
from loraplex.engine.scheduler import BATCH_GRACE_STEPS, Scheduler, SchedulerOutput
from loraplex.engine.sequence import Sequence

_ids = itertools.count()


def seq(n_prompt: int, tenant: str, *, priority: int = 0, background: bool = False) -> Sequence:
    first = next(_ids) * 1000
    s = Sequence(f"r{first}", 0, list(range(first, first + n_prompt)), SamplingParams(), tenant, None,
                 (tenant, None, ""), float(first))
    s.priority, s.background = priority, background
    return s


def complete(out: SchedulerOutput, bm: BlockManager) -> None:
    for s, n in zip(out.seqs, out.num_new_tokens, strict=True):
        s.num_computed_tokens += n
        bm.cache_blocks(s)
        if s.num_computed_tokens == len(s.token_ids):
            s.token_ids.append(7)


def run(sched: Scheduler, bm: BlockManager, steps: int) -> list[SchedulerOutput]:
    outs = []
    for _ in range(steps):
        out = sched.schedule()
        complete(out, bm)
        outs.append(out)
    return outs


def flooded(max_num_seqs: int = 8, num_blocks: int = 1000, host: int = 0) -> tuple[Scheduler, BlockManager, list]:
    bm = BlockManager(num_blocks, 16, host_tier=HostTier(host) if host else None)
    sched = Scheduler(bm, max_num_batched_tokens=256, max_num_seqs=max_num_seqs)
    flood = [seq(20, "flood") for _ in range(40)]
    for s in flood:
        sched.add(s)
    run(sched, bm, 3)
    assert len(sched.running) == max_num_seqs and all(s.tenant_id == "flood" for s in sched.running)
    return sched, bm, flood


def test_a_quiet_tenant_runs_in_the_next_step_whatever_the_flood_holds():
    sched, bm, flood = flooded()
    victim = seq(12, "quiet")
    sched.add(victim)
    out = sched.schedule()
    assert victim in out.seqs, "the quiet tenant's request must start at once"
    assert out.num_fairness_preempted == 1 and sched.num_fairness_preemptions == 1
    preempted = [s for s in flood if s.was_preempted]
    assert len(preempted) == 1
    assert preempted[0].arrival_time == max(s.arrival_time for s in flood if s.num_cached_tokens >= 0)
    complete(out, bm)
    # The flood never takes the slot back while the quiet request runs (the quiet tenant is under its share).
    for out in run(sched, bm, 10):
        assert victim in out.seqs


def test_no_preemption_when_the_waiting_tenant_is_at_its_share():
    sched, bm, _ = flooded(max_num_seqs=4)
    quiet = [seq(12, "quiet") for _ in range(6)]
    for s in quiet:
        sched.add(s)
    run(sched, bm, 6)
    running_quiet = sum(s.tenant_id == "quiet" for s in sched.running)
    assert running_quiet == 2, "equal weights over 4 slots: 2 each, no more"
    assert sched.num_fairness_preemptions == 2


def test_weights_divide_slots_in_proportion():
    bm = BlockManager(2000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=512, max_num_seqs=8)
    for _ in range(30):
        sched.add(seq(20, "a"), weight=1.0)
    run(sched, bm, 2)
    for _ in range(30):
        sched.add(seq(20, "b"), weight=3.0)
    run(sched, bm, 6)
    counts = {t: sum(s.tenant_id == t for s in sched.running) for t in ("a", "b")}
    assert counts == {"a": 2, "b": 6}


def test_work_conserving_a_lone_tenant_takes_every_slot():
    bm = BlockManager(1000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=512, max_num_seqs=8)
    for _ in range(20):
        sched.add(seq(20, "alone"))
    run(sched, bm, 2)
    assert len(sched.running) == 8


def test_a_resumed_sequence_is_not_preempted_again_for_a_while():
    sched, bm, flood = flooded(max_num_seqs=2)
    quiet = [seq(12, "quiet") for _ in range(3)]
    for s in quiet:
        sched.add(s)
    preempted_ids = set()
    for _ in range(fair_share.PROTECT_STEPS):
        out = sched.schedule()
        complete(out, bm)
        for s in flood:
            if s.protected_until > sched.num_steps:
                assert s in sched.running
        preempted_ids |= {s.seq_id for s in flood if s.was_preempted}
    assert preempted_ids


def test_interactive_work_preempts_batch_work_first_and_batch_never_preempts():
    bm = BlockManager(1000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=256, max_num_seqs=4)
    batch = [seq(20, "acme", background=True) for _ in range(10)]
    for s in batch:
        sched.add(s)
    run(sched, bm, 2)
    assert all(s.background for s in sched.running) and len(sched.running) == 4
    interactive = seq(12, "acme")  # the same tenant: its own batch yields to it
    sched.add(interactive)
    out = sched.schedule()
    assert interactive in out.seqs and out.num_fairness_preempted == 1
    complete(out, bm)
    more_batch = seq(20, "globex", background=True)
    sched.add(more_batch)
    run(sched, bm, 3)
    assert more_batch not in sched.running, "batch work waits for a free slot; it never preempts"


def test_priority_orders_work_within_a_tenant():
    bm = BlockManager(1000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=256, max_num_seqs=1)
    late_urgent = [seq(10, "t", priority=5), seq(10, "t", priority=-1)]
    for s in late_urgent:
        sched.add(s)
    out = sched.schedule()
    assert out.seqs == [late_urgent[1]]


def test_preempted_blocks_go_to_the_host_tier_and_come_back():
    sched, bm, _ = flooded(max_num_seqs=2, host=64)
    running_before = list(sched.running)
    victim = seq(12, "quiet")
    sched.add(victim)
    out = sched.schedule()
    swaps = bm.host_tier.take_swaps()
    assert sched.num_swapped_out == 1 and any(kind == TO_HOST for kind, _, _ in swaps)
    preempted = next(s for s in running_before if s not in sched.running)
    complete(out, bm)
    sched.finish(victim)
    # Another tenant's work churns the device prefix cache meanwhile; the parked blocks come back from the host.
    out = sched.schedule()
    assert preempted in out.seqs
    assert any(kind == TO_DEVICE for kind, _, _ in bm.host_tier.take_swaps()) or preempted.num_computed_tokens == 16
    assert out.num_new_tokens[out.seqs.index(preempted)] == len(preempted.token_ids) - 16


def test_prefill_tokens_are_shared_between_tenants():
    bm = BlockManager(4000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=256, max_num_seqs=8)
    for _ in range(4):
        sched.add(seq(2000, "long"))
    run(sched, bm, 1)
    short = seq(300, "short")
    sched.add(short)
    out = sched.schedule()
    assert short in out.seqs
    tokens = {t: sum(n for s, n in zip(out.seqs, out.num_new_tokens, strict=True) if s.tenant_id == t)
              for t in ("long", "short")}
    assert tokens["short"] >= 112 and tokens["long"] >= 112, tokens


def test_prefill_caps_are_work_conserving():
    fair = FairShare()
    assert fair_share.prefill_caps(256, {"a": 10, "b": 1000}, fair, 16) == {"a": 10, "b": 246}
    fair.set_weight("b", 3.0)
    caps = fair_share.prefill_caps(400, {"a": 1000, "b": 1000}, fair, 16)
    assert caps == {"a": 100, "b": 300}


def test_off_means_first_come_first_served_slots():
    bm = BlockManager(1000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=256, max_num_seqs=4, fair_sharing=False)
    for _ in range(10):
        sched.add(seq(20, "flood"))
    run(sched, bm, 2)
    victim = seq(12, "quiet")
    sched.add(victim)
    out = sched.schedule()
    assert victim not in out.seqs and sched.num_fairness_preemptions == 0


def test_on_the_cpu_a_flooding_tenant_sits_out_with_its_long_decodes_but_still_advances():
    bm = BlockManager(2000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=512, max_num_seqs=32, decode_yield_min_tokens=16)
    flood = [seq(20, "flood") for _ in range(24)]
    for s in flood:
        sched.add(s)
    run(sched, bm, 4)  # the flood runs alone: every step
    assert all(len(s.token_ids) == 24 for s in flood)
    victim = seq(12, "quiet")
    sched.add(victim)
    outs = run(sched, bm, 14)  # the quiet request stays short (under 16 tokens) all along
    flood_steps = [out for out in outs if any(s.tenant_id == "flood" for s in out.seqs)]
    assert all(victim in out.seqs for out in outs), "the quiet request runs every step"
    assert len(flood_steps) in range(1, 14 // 3 + 1), "the flood runs in few of the steps, never none"
    assert all(s.tenant_id == "quiet" for out in outs if out not in flood_steps for s in out.seqs)


def test_on_the_cpu_a_flood_runs_narrow_steps_while_another_tenant_is_around_and_all_of_it_advances():
    """CPU: while another tenant has work, and for a grace of steps after, a flooding tenant's step runs only
    CPU_FLOOD_STEP_ROWS of its sequences (the ones with the fewest tokens out): the other tenant's next request
    never waits behind a whole flood's step. Past the grace the flood runs at full width again."""
    from loraplex.engine.scheduler import CPU_FLOOD_STEP_ROWS, FLOOD_GRACE_STEPS

    bm = BlockManager(4000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=512, max_num_seqs=32, decode_yield_min_tokens=16)
    flood = [seq(20, "flood") for _ in range(24)]
    for s in flood:
        sched.add(s)
    run(sched, bm, 4)
    assert sum(s.tenant_id == "flood" for s in sched.schedule().seqs) == 24, "alone, the flood runs whole steps"
    victim = seq(12, "quiet")
    sched.add(victim)
    outs = run(sched, bm, 12)
    assert all(victim in out.seqs for out in outs)
    widths = [sum(s.tenant_id == "flood" for s in out.seqs) for out in outs]
    assert 0 < max(widths) <= CPU_FLOOD_STEP_ROWS, widths
    sched.running.remove(victim)  # the quiet request finished: the grace begins
    grace = run(sched, bm, FLOOD_GRACE_STEPS)
    assert all(len(out.seqs) == CPU_FLOOD_STEP_ROWS for out in grace), [len(out.seqs) for out in grace]
    outputs = [s.num_output_tokens for s in flood]
    assert max(outputs) - min(outputs) <= 2, f"the flood's sequences advance alike: {outputs}"
    assert sum(s.tenant_id == "flood" for s in run(sched, bm, 2)[-1].seqs) == 24, "past the grace: whole steps"


def test_on_the_cpu_a_flood_that_starts_after_another_tenants_request_runs_narrow_steps_from_its_first():
    """CPU: a flood arriving all at once just after another tenant's request ended (that tenant's next one is
    likely on its way) is admitted and run CPU_FLOOD_STEP_ROWS at a time for the grace, not in one step of all
    its prefills that the next request would wait behind; past the grace it runs whole steps."""
    from loraplex.engine.scheduler import CPU_FLOOD_STEP_ROWS, FLOOD_GRACE_STEPS

    bm = BlockManager(4000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=512, max_num_seqs=32, decode_yield_min_tokens=16)
    quiet = seq(12, "quiet")
    sched.add(quiet)
    run(sched, bm, 2)
    sched.finish(quiet)  # its request ended; the engine may idle for a while, which takes no steps
    flood = [seq(20, "flood") for _ in range(24)]
    for s in flood:
        sched.add(s)
    grace = run(sched, bm, FLOOD_GRACE_STEPS - 2)
    assert all(0 < len(out.seqs) <= CPU_FLOOD_STEP_ROWS for out in grace), [len(out.seqs) for out in grace]
    assert sum(len(s.token_ids) > 20 for s in flood) >= CPU_FLOOD_STEP_ROWS, "the flood advances meanwhile"
    widths = [len(out.seqs) for out in run(sched, bm, 12)]
    assert max(widths) == 24, f"past the grace: whole steps {widths}"


def test_on_the_cpu_a_flood_does_not_join_the_first_step_of_a_short_request_about_to_start():
    """CPU: the step in which a flood would run (one in `yield_period`) is deferred, once, when what runs
    without it ends within the period, a short request of another tenant that waits to start included: a
    steady client whose cycle matched the period otherwise had the flood in the first step of every request."""
    from loraplex.engine.scheduler import yield_period

    bm = BlockManager(4000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=512, max_num_seqs=32, decode_yield_min_tokens=16)
    flood = [seq(20, "flood") for _ in range(6)]
    for s in flood:
        sched.add(s)
    run(sched, bm, 20)  # the flood alone, past 16 tokens each
    period = yield_period(len(flood))
    while (sched.num_steps + 1) % period:
        run(sched, bm, 1)
    short = seq(12, "quiet")
    short.sampling = SamplingParams(max_tokens=period - 1)
    sched.add(short)
    first = sched.schedule()
    assert [s.tenant_id for s in first.seqs] == ["quiet"], "the short request's first step runs without the flood"
    complete(first, bm)
    outs = run(sched, bm, 2 * period)
    assert any(any(s.tenant_id == "flood" for s in out.seqs) for out in outs), "the flood still advances"


def test_on_the_cpu_batch_work_sits_out_every_step_interactive_work_has_and_runs_short_steps_alone():
    """CPU scheduling (decode yielding on): a step costs in proportion to its rows, so batch rows never share
    a step with interactive work, and a step of batch work alone stays within CPU_BATCH_STEP_TOKENS, so an
    interactive request arriving meanwhile waits for little."""
    from loraplex.engine.scheduler import CPU_BATCH_STEP_TOKENS

    bm = BlockManager(1000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=2048, max_num_seqs=16, decode_yield_min_tokens=16)
    batch = [seq(100, "acme", background=True) for _ in range(8)]
    for s in batch:
        sched.add(s)
    alone = run(sched, bm, 6)
    assert all(sum(out.num_new_tokens) <= CPU_BATCH_STEP_TOKENS for out in alone)
    assert sum(sum(out.num_new_tokens) for out in alone) > 0, "batch work runs when nothing else does"
    victim = seq(12, "globex")
    sched.add(victim)
    shared = run(sched, bm, 4)
    assert all(out.seqs == [victim] for out in shared), [[s.tenant_id for s in out.seqs] for out in shared]
    sched.running.remove(victim)  # the victim finished: batch work resumes
    assert any(s.background for s in sched.schedule().seqs)


def test_on_the_cpu_batch_work_runs_narrow_steps_for_a_grace_after_interactive_work():
    """CPU: after interactive work had some, batch work's steps run only CPU_FLOOD_STEP_ROWS of its lines for
    FLOOD_GRACE_STEPS steps (an interactive request arriving then waits for a narrow step), then full ones."""
    from loraplex.engine.scheduler import CPU_FLOOD_STEP_ROWS, FLOOD_GRACE_STEPS

    bm = BlockManager(4000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=2048, max_num_seqs=32, decode_yield_min_tokens=16)
    batch = [seq(20, "acme", background=True) for _ in range(20)]
    for s in batch:
        sched.add(s)
    run(sched, bm, 8)  # 400 prompt tokens, at most CPU_BATCH_STEP_TOKENS a step
    assert len(sched.schedule().seqs) == 20, "alone, batch work runs whole steps"
    victim = seq(12, "globex")
    sched.add(victim)
    assert all(out.seqs == [victim] for out in run(sched, bm, 3))
    sched.running.remove(victim)
    grace = run(sched, bm, FLOOD_GRACE_STEPS)
    assert all(len(out.seqs) == CPU_FLOOD_STEP_ROWS and all(s.background for s in out.seqs) for out in grace)
    assert len(run(sched, bm, 1)[0].seqs) == 20, "past the grace: whole steps"


def test_on_a_gpu_batch_work_sits_out_the_interactive_prefill_step_then_runs_beside_the_decodes():
    """GPU scheduling (decode yielding off): a step with a prefill cannot replay the decode graphs, so the
    many batch rows sit out the interactive request's prefill step; its decodes then share steps with them."""
    bm = BlockManager(1000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=2048, max_num_seqs=16)
    for s in [seq(100, "acme", background=True) for _ in range(8)]:
        sched.add(s)
    run(sched, bm, 2)
    victim = seq(12, "globex")
    sched.add(victim)
    (prefill,) = run(sched, bm, 1)
    assert prefill.seqs == [victim] and prefill.num_new_tokens == [12]
    (decode,) = run(sched, bm, 1)
    assert {s.tenant_id for s in decode.seqs} == {"acme", "globex"}
    assert all(n == 1 for n in decode.num_new_tokens)


def test_on_a_gpu_a_flood_sits_out_another_tenants_prefill_steps_but_never_more_than_a_few_in_a_row():
    from loraplex.engine.scheduler import MAX_FLOOD_SIT_OUT_STEPS

    bm = BlockManager(4000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=32)
    flood = [seq(20, "flood") for _ in range(16)]
    for s in flood:
        sched.add(s)
    run(sched, bm, 8)  # the flood alone: admitted and decoding
    assert all(s.num_computed_tokens >= 20 for s in flood)
    short = seq(10, "quiet")
    sched.add(short)
    (alone,) = run(sched, bm, 1)
    assert alone.seqs == [short], "the short prompt's step runs without the flood"
    (together,) = run(sched, bm, 1)
    assert short in together.seqs and len(together.seqs) == 17, "then it decodes beside the flood"
    long_prompt = seq(64 * 12, "other")  # twelve chunks: the flood may not wait for all of them
    sched.add(long_prompt)
    outs = run(sched, bm, 12)
    flood_ran = [any(s.tenant_id == "flood" for s in out.seqs) for out in outs]
    streak = longest = 0
    for ran in flood_ran:
        streak = 0 if ran else streak + 1
        longest = max(longest, streak)
    assert longest == MAX_FLOOD_SIT_OUT_STEPS, flood_ran
    assert any(flood_ran)


def _batch_beside_interactive(sched: Scheduler, bm: BlockManager, num_lines: int) -> tuple[Sequence, list[Sequence]]:
    """An interactive request and `num_lines` batch lines queued, two steps run: the request and the running lines."""
    interactive = seq(8, "globex")
    sched.add(interactive)
    for _ in range(num_lines):
        sched.add(seq(8, "acme", background=True))
    run(sched, bm, 2)
    return interactive, [s for s in sched.running if s.background]


def test_on_a_gpu_batch_work_is_admitted_in_waves_while_interactive_work_runs():
    bm = BlockManager(4000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=2048, max_num_seqs=16, batch_admission_wave=0.25,
                      batch_prefill_tokens_beside_interactive=0)  # uncapped: a wave comes in in one step
    wave = 4
    interactive, running_batch = _batch_beside_interactive(sched, bm, 15 + 2 * wave)
    assert len(running_batch) == 15
    sched.running.remove(running_batch[0])  # one line finished: one slot is free, less than a wave
    assert not any(s.background and s.num_computed_tokens == 0 for s in sched.schedule().seqs)
    for done in running_batch[1:wave]:
        sched.running.remove(done)  # now a wave's worth of slots is free
    sched.schedule()
    admitted = [s for s in sched.running if s.background and s not in running_batch]
    assert len(admitted) == wave
    sched.running.remove(interactive)  # the interactive request ended: the next one may come within a few steps
    sched.running.remove(admitted[0])
    sched.schedule()
    assert len([s for s in sched.running if s.background]) == 14, "two free slots, less than a wave, in the grace"
    for _ in range(BATCH_GRACE_STEPS):
        sched.schedule()
    assert len([s for s in sched.running if s.background]) == 16, "no interactive work since: admitted as slots free"


def test_on_a_gpu_batch_work_runs_few_rows_beside_interactive_work_and_full_width_alone():
    """GPU scheduling: while interactive work runs, batch work runs batch_rows_beside_interactive rows a step (its
    lines furthest along), the rest of its lines sit out without losing their blocks, and no new line comes in until
    those rows free room; alone again, every line runs."""
    bm = BlockManager(4000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=2048, max_num_seqs=16, batch_rows_beside_interactive=4)
    early = [seq(8, "acme", background=True) for _ in range(3)]
    for s in early:
        sched.add(s)
    run(sched, bm, 2)  # three lines ahead of the rest
    late = [seq(8, "acme", background=True) for _ in range(13)]
    queued = [seq(8, "acme", background=True) for _ in range(4)]
    for s in late + queued:
        sched.add(s)
    (alone,) = run(sched, bm, 1)
    assert sum(s.background for s in alone.seqs) == 16, "batch work alone runs at full width"
    interactive = seq(8, "globex")
    sched.add(interactive)  # takes a batch line's slot (batch work is preempted first)
    run(sched, bm, 1)  # its prompt
    for _ in range(6):
        (out,) = run(sched, bm, 1)
        batch_rows = [s for s in out.seqs if s.background]
        assert interactive in out.seqs and len(batch_rows) == 4
        assert set(early) <= set(batch_rows), "the lines furthest along run"
    sitting_out = [s for s in late if s in sched.running]
    assert len(sitting_out) == 12 and all(s.num_computed_tokens > 0 and s.block_table for s in sitting_out), \
        "lines sitting out keep their slots and blocks"
    for done in early:
        sched.finish(done)  # three lines end: their rows go to running lines, no new line comes in
    (out,) = run(sched, bm, 1)
    assert sum(s.background for s in out.seqs) == 4 and all(s.num_computed_tokens == 0 for s in queued)
    sched.finish(interactive)
    (out,) = run(sched, bm, 1)
    assert sum(s.background for s in out.seqs) == 4, "the next interactive request may come within a few steps"
    *_, out = run(sched, bm, BATCH_GRACE_STEPS)
    assert sum(s.background for s in out.seqs) == 16, "alone again: every running line, and waiting ones come in"


def test_on_a_gpu_batch_lines_are_admitted_in_waves_of_the_rows_beside_interactive_work():
    bm = BlockManager(4000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=2048, max_num_seqs=64, batch_rows_beside_interactive=16,
                      batch_admission_wave=0.125, batch_prefill_tokens_beside_interactive=0)
    _, running = _batch_beside_interactive(sched, bm, 40)
    assert len(running) == 16, "interactive work running: batch lines fill only its rows"
    sched.finish(running[0])  # one row free: less than a wave (2 of 16)
    (out,) = run(sched, bm, 1)
    assert sum(s.background for s in out.seqs) == 15 and sum(s.background for s in sched.running) == 15
    sched.finish(running[1])
    (out,) = run(sched, bm, 1)
    assert sum(s.background for s in sched.running) == 16, "a wave's worth of room: two lines come in together"
    assert sum(s.background and n > 1 for s, n in zip(out.seqs, out.num_new_tokens, strict=True)) == 2


def test_with_no_admission_wave_batch_lines_come_in_as_slots_free():
    bm = BlockManager(4000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=2048, max_num_seqs=16, batch_admission_wave=0,
                      batch_prefill_tokens_beside_interactive=0)  # uncapped: the lines' prompts end in a step
    _, running_batch = _batch_beside_interactive(sched, bm, 20)
    assert len(running_batch) == 15
    sched.running.remove(running_batch[0])  # one line finished: its slot takes the next line at once
    out = sched.schedule()
    assert sum(s.background and s.num_computed_tokens == 0 for s in out.seqs) == 1


def test_batch_prompt_tokens_are_capped_a_step_beside_interactive_work_and_a_wave_fills_its_room_over_steps():
    """GPU scheduling with batch_prefill_tokens_beside_interactive: while interactive work runs, no step carries
    more batch prompt tokens than the cap (a line's prompt is chunked across steps if need be), the interactive
    request's own tokens are never held back, and an admission wave stays open over steps until its room is
    filled; alone, batch prompts take the step's whole budget again."""
    bm = BlockManager(4000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=2048, max_num_seqs=16, batch_admission_wave=0.5,
                      batch_prefill_tokens_beside_interactive=20)
    interactive = seq(40, "globex")
    sched.add(interactive)
    lines = [seq(12, "acme", background=True) for _ in range(12)]
    for line in lines:
        sched.add(line)
    first = sched.schedule()
    assert first.seqs[0] is interactive and first.num_new_tokens[0] == 40, "interactive prompt runs whole"
    complete(first, bm)
    admitted: set[int] = set()
    chunked = False
    for _ in range(12):
        out = sched.schedule()
        prompt_chunks = [(s, n) for s, n in zip(out.seqs, out.num_new_tokens, strict=True)
                         if s.background and s.num_computed_tokens < s.num_prompt_tokens]
        assert sum(n for _, n in prompt_chunks) <= 20 and interactive in out.seqs
        chunked |= any(s.num_computed_tokens + n < s.num_prompt_tokens for s, n in prompt_chunks)
        admitted |= {s.seq_id for s in out.seqs if s.background}
        complete(out, bm)
    assert admitted == {line.seq_id for line in lines}, "the wave stayed open until every line came in"
    assert chunked, "a prompt past the step's cap is chunked"
    sched.finish(interactive)
    run(sched, bm, BATCH_GRACE_STEPS)  # the next interactive request may come within a few steps: none did
    late = [seq(300, "acme", background=True) for _ in range(2)]
    for line in late:
        sched.add(line)
    (alone,) = run(sched, bm, 1)
    assert sum(n for s, n in zip(alone.seqs, alone.num_new_tokens, strict=True) if s in late) == 600, \
        "batch work alone: no cap"


def test_the_batch_rows_beside_interactive_work_and_admission_wave_are_settings_with_defaults():
    from loraplex.engine.config import HOST_BOUND_WEIGHT_BYTES, EngineConfig
    from loraplex.platform.settings import Settings
    from loraplex.platform.wiring import engine_config

    assert EngineConfig().batch_rows_beside_interactive == Settings().batch_rows_beside_interactive == 0
    assert EngineConfig().batch_admission_wave is Settings().batch_admission_wave is None
    assert EngineConfig().batch_prefill_tokens_beside_interactive is None
    assert Settings().batch_prefill_tokens_beside_interactive is None
    # unset: by the model's size, a decode step bound by reading weights (8B) or by the host's work (135M)
    large, small = 16 << 30, 270 << 20
    assert small < HOST_BOUND_WEIGHT_BYTES <= large
    assert EngineConfig().resolve_batch_prefill_tokens_beside_interactive(large) == 32
    assert EngineConfig().resolve_batch_admission_wave(large) == 0.25
    assert EngineConfig().resolve_batch_prefill_tokens_beside_interactive(small) == 0
    assert EngineConfig().resolve_batch_admission_wave(small) == 0.5
    config = engine_config(Settings(batch_rows_beside_interactive=16, batch_admission_wave=0.5,
                                    batch_prefill_tokens_beside_interactive=64))
    assert config.batch_rows_beside_interactive == 16 and config.batch_admission_wave == 0.5
    assert config.batch_prefill_tokens_beside_interactive == 64
    assert config.resolve_batch_prefill_tokens_beside_interactive(small) == 64, "a setting wins over the size"
    assert config.resolve_batch_admission_wave(large) == 0.5
    with pytest.raises(ValueError):
        Settings(batch_admission_wave=1.5)


def test_the_engine_gives_its_scheduler_the_batch_limits_of_its_models_size(smol):
    from enginecore_helpers import tiny_random_config
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine

    tiny = LLMEngine.from_random(tiny_random_config(), EngineConfig(num_blocks=64, max_model_len=128),
                                 smol.tokenizer)
    assert (tiny.scheduler.batch.prefill_tokens, tiny.scheduler.batch.wave) == (0, 0.5)
    set_here = LLMEngine.from_random(tiny_random_config(), EngineConfig(
        num_blocks=64, max_model_len=128, batch_prefill_tokens_beside_interactive=24), smol.tokenizer)
    assert set_here.scheduler.batch.prefill_tokens == 24


def test_a_flood_stops_short_of_the_kept_slots_and_a_newcomer_starts_without_a_preemption():
    bm = BlockManager(1000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=256, max_num_seqs=8, newcomer_reserved_slots=2)
    for _ in range(40):
        sched.add(seq(20, "flood"))
    run(sched, bm, 4)
    assert len(sched.running) == 6, "a lone tenant fills every slot but the kept ones"
    first = seq(12, "quiet")
    sched.add(first)
    out = sched.schedule()
    assert first in out.seqs and sched.num_fairness_preemptions == 0
    complete(out, bm)
    # A second request of the newcomer takes the last kept slot (it is under its share of 8 among 3)...
    second = seq(12, "quiet")
    sched.add(second)
    out = sched.schedule()
    assert second in out.seqs and len(sched.running) == 8 and sched.num_fairness_preemptions == 0
    complete(out, bm)
    # ...and when one finishes, the flood does not take the freed kept slot back.
    sched.finish(first)
    run(sched, bm, 3)
    assert sum(s.tenant_id == "flood" for s in sched.running) == 6 and len(sched.running) == 7


def test_batch_work_takes_the_kept_slots_only_while_no_interactive_work_runs():
    bm = BlockManager(1000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=256, max_num_seqs=8, newcomer_reserved_slots=2)
    for _ in range(20):
        sched.add(seq(20, "batchco", background=True))
    run(sched, bm, 4)
    assert len(sched.running) == 8 and all(s.background for s in sched.running), "alone, batch work fills the engine"
    chat = seq(12, "chatco")
    sched.add(chat)
    out = sched.schedule()
    assert chat in out.seqs and out.num_fairness_preempted == 1, "an interactive request preempts a batch line"
    complete(out, bm)
    for line in [s for s in sched.running if s.background][:2]:
        sched.finish(line)
    run(sched, bm, 4)
    assert chat in sched.running and len(sched.running) == 6, "while it runs, batch lines leave the kept slots free"


def test_the_default_keeps_one_slot_in_32_and_none_below_32():
    from loraplex.engine.config import EngineConfig

    assert EngineConfig(max_num_seqs=64).resolve_newcomer_reserved_slots() == 2
    assert EngineConfig(max_num_seqs=16).resolve_newcomer_reserved_slots() == 0
    assert EngineConfig(max_num_seqs=4, newcomer_reserved_slots=9).resolve_newcomer_reserved_slots() == 3


def test_without_mixed_step_graphs_the_flood_sits_out_every_quiet_prefill():
    """Without mixed-step graphs (eager steps), the flood's decodes sit out the step running another tenant's
    prompt, whatever its length, so that step costs what it costs alone; with the sit-out off they join it."""
    for max_prompt_tokens in (None, 0):
        bm = BlockManager(1000, 16)
        sched = Scheduler(bm, max_num_batched_tokens=256, max_num_seqs=32,
                          flood_sit_out_prompt_tokens=max_prompt_tokens)
        flood = [seq(20, "flood") for _ in range(16)]
        for s in flood:
            sched.add(s)
        run(sched, bm, 3)
        victim = seq(200, "quiet")
        sched.add(victim)
        out = sched.schedule()
        assert victim in out.seqs and out.num_new_tokens[out.seqs.index(victim)] == 200
        flood_rows = [s for s in out.seqs if s.tenant_id == "flood"]
        assert flood_rows == [] if max_prompt_tokens is None else len(flood_rows) == 16


def test_with_mixed_step_graphs_the_flood_sits_out_only_a_short_prompts_first_step_and_not_often():
    """With mixed-step graphs, the step admitting another tenant's short prompt runs without the flood (its own
    rows alone: the newcomer's first token comes from a small step); the flood runs in the next step beside the
    newcomer's decode, does not sit out again for FLOOD_SHORT_SIT_OUT_EVERY steps whoever arrives, and never
    for a long prompt, which costs about the same with or without it."""
    from loraplex.engine.scheduler import FLOOD_SHORT_SIT_OUT_EVERY

    bm = BlockManager(2000, 16)
    sched = Scheduler(bm, max_num_batched_tokens=512, max_num_seqs=32, flood_sit_out_prompt_tokens=64)
    flood = [seq(20, "flood") for _ in range(16)]
    for s in flood:
        sched.add(s)
    run(sched, bm, FLOOD_SHORT_SIT_OUT_EVERY + 1)

    def flood_rows(out: SchedulerOutput) -> int:
        return sum(s.tenant_id == "flood" for s in out.seqs)

    short = seq(40, "quiet")
    sched.add(short)
    first = sched.schedule()
    complete(first, bm)
    assert first.seqs == [short] and first.num_new_tokens == [40]
    second = sched.schedule()
    complete(second, bm)
    assert short in second.seqs and flood_rows(second) == 16
    another = seq(30, "other")
    sched.add(another)
    soon = sched.schedule()
    complete(soon, bm)
    assert another in soon.seqs and flood_rows(soon) == 16, "a second sit-out this soon"
    run(sched, bm, FLOOD_SHORT_SIT_OUT_EVERY)
    long = seq(65, "quiet")
    sched.add(long)
    out = sched.schedule()
    assert long in out.seqs and flood_rows(out) == 16, "a long prompt's step is not sat out"


def test_only_single_rank_cuda_engines_with_graphs_replay_mixed_steps():
    from loraplex.engine.config import EngineConfig

    assert EngineConfig(device="cuda").mixed_steps_replay_graphs()
    assert not EngineConfig(device="cpu").mixed_steps_replay_graphs()
    assert not EngineConfig(device="cuda", cuda_graph_mixed_steps=False).mixed_steps_replay_graphs()
    assert not EngineConfig(device="cuda", enable_cuda_graphs=False).mixed_steps_replay_graphs()
    assert not EngineConfig(device="cuda", tensor_parallel_size=2).mixed_steps_replay_graphs()


def test_the_short_prompt_sit_out_is_an_operator_setting_off_by_default():
    from loraplex.engine.config import EngineConfig
    from loraplex.platform.settings import Settings
    from loraplex.platform.wiring import engine_config

    assert EngineConfig().flood_sit_out_prompt_tokens == 0 and Settings().flood_sit_out_prompt_tokens == 0
    assert engine_config(Settings(flood_sit_out_prompt_tokens=64)).flood_sit_out_prompt_tokens == 64


def test_the_kept_slots_run_on_top_of_max_num_seqs():
    from loraplex.engine.config import EngineConfig

    assert EngineConfig(max_num_seqs=64).running_slots() == 66
    assert EngineConfig(max_num_seqs=64, fair_sharing=False).running_slots() == 64
    assert EngineConfig(max_num_seqs=16).running_slots() == 16


def test_a_lone_flood_fills_max_num_seqs_and_a_newcomer_runs_beside_all_of_it(smol):
    """In the engine: one tenant's flood runs max_num_seqs sequences (as with fair sharing off), and another
    tenant's request runs in a kept slot beside every one of them, without a preemption."""
    from enginecore_helpers import tiny_random_config
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.engine.protocol import EngineRequest

    engine = LLMEngine.from_random(tiny_random_config(), EngineConfig(
        num_blocks=512, max_model_len=256, max_num_seqs=32, max_num_batched_tokens=512), smol.tokenizer)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i in range(40):
        engine.add_request(EngineRequest(f"flood-{i}", [1, 2, 3, 4 + i], params, tenant_id="flood"))
    for _ in range(4):
        engine.step()
    flood = [s for s in engine.scheduler.running if s.tenant_id == "flood"]
    assert len(flood) == 32 and len(engine.scheduler.running) == 32
    engine.add_request(EngineRequest("quiet", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0),
                                     tenant_id="quiet"))
    engine.step()
    assert any(s.tenant_id == "quiet" for s in engine.scheduler.running)
    assert len(engine.scheduler.running) == 33 and engine.scheduler.num_fairness_preemptions == 0
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
