"""Which sequences run this step, and how many of their tokens.

One token budget per step, no prefill/decode phases (as vLLM v1): each
running sequence's computed tokens catch up with its tokens. Decodes are
scheduled first so a long prompt, prefilled in chunks, never stalls them.
When blocks run out the newest running sequence is preempted (its blocks
freed, recomputed later).

Tenants share the engine by weighted fair shares (engine/fair_share.py), on
by default: running slots, KV blocks (pinned session blocks count against
their tenant) and each step's prefill tokens. New work is admitted from the
tenant furthest under its share. When a tenant under its share has work
waiting and no slot or blocks are free, the newest sequence of the tenant
furthest over its share is preempted: its cached blocks parked in the host
KV tier when there is room (engine/kv/preempt_swap.py), otherwise recomputed
from the prefix cache. A resumed sequence is not preempted for fairness
again for a while, and produces exactly the tokens it would have. Within a
tenant, `priority` orders requests (lower first); batch work (`background`)
runs on what interactive work leaves and is preempted first; on a GPU it is
admitted in waves while interactive work runs, its prompts at most
`batch_prefill_tokens_beside_interactive` tokens a step, and
`batch_rows_beside_interactive` can cap its rows in those steps. Never touches
a tensor.

On a device where a step's cost grows with its batch (the CPU), a long
generation slows every other tenant's short one for as long as it runs.
With `decode_yield_min_tokens` set, a decode that has produced at least
that many tokens, and at least twice as many as a running sequence of
another tenant, runs in only one step of every `yield_period` (least
attained service first): short requests of others run at nearly their quiet
speed, and the long one still advances at a third of its speed or more,
never starved. (On the 2-core CPU a second sequence makes a step ~1.8x as
costly; sitting out every other step still left the short one 1.5x slower.)
A flooding tenant's steps, and batch work's, also run only a few rows while
another tenant is around and for a grace of steps after (a flood that begins
in that grace is narrowed from its first step): a request arriving between
another tenant's requests waits for a narrow step, not a whole one.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.engine import fair_share
from loraplex.engine.batch_beside_interactive import BACKGROUND, BatchBesideInteractive
from loraplex.engine.fair_share import FairShare, admission_key
from loraplex.engine.kv import preempt_swap
from loraplex.engine.kv.block_manager import BlockManager
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.engine.spec.policy import Speculation
from loraplex.engine.spec.verify import num_accepted

SERVICE_DECAY = 0.9  # per step: "recent" service fades, so a tenant's past burst is forgotten
DECODE_YIELD_PERIOD = 3  # a yielding decode runs in one step of this many (more when many yield together)
MAX_DECODE_YIELD_PERIOD = 12
# The token budget of a CPU step that runs batch work alone (see _has_interactive_work): an interactive request
# arriving meanwhile waits for that step. On a 2-core CPU a step of 256 tokens of batch prefills took 0.7-0.8 s; one
# of 64 costs about what the batch's full-width decode step does (~0.2 s). Lone batch prefill runs ~20% slower.
CPU_BATCH_STEP_TOKENS = 64
FLOOD_MIN_SEQS, FLOOD_RATIO = 4, 4  # a tenant running this many sequences, this many times another's, floods
NEWCOMER = "\x00newcomer"  # the tenant that may come next, at the default weight (never a real tenant id)
# CPU: a flooding tenant's step runs at most this many of its rows while another tenant has work or had some
# within the last FLOOD_GRACE_STEPS steps, and batch work as many while interactive work had some (see
# _narrow_step_allowance)
CPU_FLOOD_STEP_ROWS = 4
FLOOD_GRACE_STEPS = 32
# GPU: batch work keeps its limits beside interactive work for this many steps after the last interactive work
# (a client's next request comes within a few steps of its last one's end)
BATCH_GRACE_STEPS = 32
MAX_FLOOD_SIT_OUT_STEPS = 4  # GPU: a flood sits out at most this many steps in a row for others' prefills
# GPU with mixed-step graphs: a flood sits out the step admitting another tenant's short prompt at most once in this
# many steps, so many tiny requests of one tenant cannot hold a flood below 3/4 of its speed
FLOOD_SHORT_SIT_OUT_EVERY = 4


def yield_period(num_yielding: int) -> int:
    """One step in this many runs the yielding decodes: on the CPU their step costs more the more of them there
    are, so the period grows with them (a flood of 24 long streams runs 1 step in 7), keeping the short request's
    mean step near its quiet cost; the long ones still advance, never starved."""
    return min(MAX_DECODE_YIELD_PERIOD, DECODE_YIELD_PERIOD + num_yielding // 6)
MAX_FAIRNESS_PREEMPTIONS_PER_STEP = 8  # bounds one step's host work; a bigger imbalance closes over a few steps


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # 0 for a fork child sampling its parent's row
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0  # for lack of blocks (the step then admits nothing new)
    num_fairness_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """`adapter_ready(adapter_id) -> bool` gates admission of adapter requests (default: always
    ready); a request whose adapter is not ready waits without blocking others, and one whose
    `adapter_ready` raises is failed by the engine with that error."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        adapter_ready: Callable[[str], bool] | None = None,
        decode_yield_min_tokens: int = 0,
        fair_sharing: bool = True,
        newcomer_reserved_slots: int = 0,
        flood_sit_out_prompt_tokens: int | None = None,
        batch_rows_beside_interactive: int = 0,
        batch_admission_wave: float = 0.25,
        batch_prefill_tokens_beside_interactive: int = 32,  # EngineConfig resolves both by the model's size
    ) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.adapter_ready = adapter_ready
        self.waiting: dict[str, deque[Sequence]] = {}  # per tenant, preempted sequences included
        self.running: list[Sequence] = []
        self.pending_forks: dict[int, list[Sequence]] = {}
        self._fork_parents: dict[int, Sequence] = {}  # each pending_forks key's sequence
        self.tenant_service: dict[str, float] = {}
        self.decode_yield_min_tokens = decode_yield_min_tokens  # 0: never yield
        self.num_steps = 0
        self.num_yielded_decodes = 0
        self.num_preemptions = 0
        self.fair_sharing = fair_sharing
        self.fair = FairShare()
        self.newcomer_reserved_slots = newcomer_reserved_slots if fair_sharing else 0
        self.num_fairness_preemptions = 0
        self.num_swapped_out = 0  # preempted sequences whose blocks went to the host tier
        self._flood_sit_out_streak = 0  # steps in a row the flooding tenants sat out for others' prefills
        self._tenants_seen_step: dict[str, int] = {}  # CPU: the last step each tenant had work (within the grace)
        self._interactive_seen_step = -max(FLOOD_GRACE_STEPS, BATCH_GRACE_STEPS) - 1  # the last step interactive work ran or waited
        # None: a flood sits out every step that runs another tenant's interactive prefill (steps with a prefill run
        # eagerly); a number: steps with a prefill replay mixed-step graphs, and a flood sits out only the step
        # admitting another tenant's prompt of at most that many tokens (0: never)
        self.flood_sit_out_prompt_tokens = flood_sit_out_prompt_tokens
        self._last_short_sit_out_step = -FLOOD_SHORT_SIT_OUT_EVERY
        # GPU: batch work's rows, admission waves and prompt tokens while interactive work runs or waits
        self.batch = BatchBesideInteractive(batch_rows_beside_interactive, batch_admission_wave,
                                            batch_prefill_tokens_beside_interactive)
        self._sat_out_since = 0  # CPU: the step since which the long decodes have sat out (see _long_decodes_run)
        # Waiting sequences whose adapter_ready raised: the engine fails their requests.
        self.failed: dict[int, tuple[Sequence, Exception]] = {}
        self.speculation: Speculation | None = None  # drafts for decodes (engine/spec); None: off

    # ---- queue management -----------------------------------------------------------------
    def add(self, seq: Sequence, fork_children: list[Sequence] | None = None, weight: float | None = None) -> None:
        """Queue `seq` (with the children that fork from it once its prompt is computed); `weight`: its tenant's
        weight in fair sharing (the latest request's weight wins)."""
        if weight is not None:
            self.fair.set_weight(seq.tenant_id, weight)
        self.waiting.setdefault(seq.tenant_id, deque()).append(seq)
        if fork_children:
            self.pending_forks[seq.seq_id] = fork_children
            self._fork_parents[seq.seq_id] = seq

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def waiting_seqs(self) -> list[Sequence]:
        return [s for q in list(self.waiting.values()) for s in list(q)]

    @property
    def num_running(self) -> int:
        return len(self.running)

    def num_slots_taken(self) -> int:
        """Running sequences, and the choices running parents fork once their prompt is computed: a request's `n`
        choices hold `n` slots from its admission on. Forked past the slots, they made steps of more rows than the
        engine runs (on a GPU, more than its largest graph: such a step failed)."""
        if not self.pending_forks:
            return len(self.running)
        forks = sum(len(children) for seq_id, children in self.pending_forks.items()
                    if self._fork_parents[seq_id].status is SequenceStatus.RUNNING)
        return len(self.running) + forks

    def slots_needed(self, seq: Sequence) -> int:
        """The slots `seq` takes when admitted: itself and the choices it will fork."""
        return 1 + len(self.pending_forks.get(seq.seq_id, ()))

    def running_adapter_ids(self) -> list[str | None]:
        """The adapters running sequences hold (read from other threads too: a copy of the list)."""
        return [s.adapter_id for s in list(self.running)]

    def queued_adapter_ids(self) -> list[str | None]:
        """The adapters waiting and preempted sequences need. Other threads read this while the engine
        thread changes the queues: retry on a concurrent resize."""
        for _ in range(5):
            try:
                return [s.adapter_id for s in self.waiting_seqs()]
            except RuntimeError:
                continue
        return []

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def finish(self, seq: Sequence) -> None:
        """Remove `seq` wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            queue = self.waiting.get(seq.tenant_id)
            if queue is not None and seq in queue:
                queue.remove(seq)
                if not queue:
                    del self.waiting[seq.tenant_id]
            preempt_swap.discard(self.block_manager, seq)
        self._fork_parents.pop(seq.seq_id, None)
        for child in self.pending_forks.pop(seq.seq_id, []):
            child.status = SequenceStatus.FINISHED
        seq.status = SequenceStatus.FINISHED
        seq.spec_token_ids = []
        self.block_manager.deallocate(seq)

    # ---- the step -------------------------------------------------------------------------
    def schedule(self, drafts: bool = True) -> SchedulerOutput:
        """The next step. `drafts=False`: no decode drafts (a step scheduled ahead of the one in flight, whose
        sequences' last tokens are placeholders: engine/step_overlap.py)."""
        out = SchedulerOutput()
        for tenant in self.tenant_service:
            self.tenant_service[tenant] *= SERVICE_DECAY
        budget = self.max_num_batched_tokens
        self.num_steps += 1
        if self.fair_sharing:
            self._preempt_for_fairness(out)
        yielding = self._yielding_decodes()
        flooding = self._flooding_tenants()
        if self._long_decodes_run(yielding | {s.seq_id for s in self.running if s.tenant_id in flooding}):
            yielding, flooding = set(), set()  # the long decodes' step
        flooding = flooding or self._floods_sitting_out_for_a_prefill()
        batch_waits = batch_trickles = False
        if self.decode_yield_min_tokens:  # the CPU: batch work must never lengthen an interactive request's steps
            batch_waits = self._interactive_work_now()
            if not batch_waits:
                budget = min(budget, CPU_BATCH_STEP_TOKENS)
        allowance = self._narrow_step_allowance(batch_waits)
        beside_interactive = not self.decode_yield_min_tokens and self._interactive_within_grace()
        self.batch.begin_step(beside_interactive)
        if beside_interactive:
            allowance = self.batch.rows_allowance(self.running)
            batch_trickles = self.batch.waits_for_a_wave(self.max_num_seqs - self.num_slots_taken(),
                                                         self.max_num_seqs, allowance)
        # Decodes first, then prefill chunks, each group in admission order.
        order = sorted(self.running, key=lambda s: s.num_uncomputed_tokens > 1)
        caps = self._prefill_caps(order, budget, yielding)
        drafting = drafts and self.speculation is not None and self.speculation.allows_step(
            sum(1 for s in order if s.num_uncomputed_tokens == 1))
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if (seq.seq_id in yielding or seq.tenant_id in flooding or (batch_waits and seq.background)
                    or not _allowed(seq, allowance)):
                self.num_yielded_decodes += 1
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new > 1 and caps is not None:
                num_new = min(num_new, caps.get(seq.tenant_id, 0))
                if num_new <= 0:
                    continue
                caps[seq.tenant_id] -= num_new
            batch_prefill = seq.background and seq.num_uncomputed_tokens > 1
            if batch_prefill:
                num_new = self.batch.prefill_chunk(num_new)
                if num_new <= 0:
                    continue
            if drafting and num_new == 1:
                num_new += self._draft(seq, budget - 1)
            if not self._make_room(seq, num_new, out):
                continue
            budget -= self._schedule_seq(seq, num_new, out)
            if batch_prefill:
                self.batch.take_prefill(num_new)
        if out.num_preempted == 0:
            room = {t: self._step_rows(t) - len(allowed) for t, allowed in allowance.items()}
            self._admit(budget, out, skip_tenants=flooding, skip_background=batch_waits or batch_trickles,
                        tenant_room=room)
        return out

    def _long_decodes_run(self, sitting_out: set[int]) -> bool:
        """Whether the decodes that would sit out this step (CPU) run in it: one step in `yield_period`, unless
        what runs without them finishes within that many steps: then they wait for it, once (at most two periods
        without a step). A short request is not interrupted just before its end (on the CPU a flood's step costs
        several of its own, ~0.1 s of a 0.8 s 8-token request), and a stream of such requests slows the long
        decodes at most twice as much, never stops them."""
        if not sitting_out:
            self._sat_out_since = self.num_steps
            return False
        period = yield_period(len(sitting_out))
        if self.num_steps % period:
            return False
        if self.num_steps - self._sat_out_since < 2 * period and self._others_finish_within(period, sitting_out):
            return False
        self._sat_out_since = self.num_steps
        return True

    def _others_finish_within(self, num_steps: int, sitting_out: set[int]) -> bool:
        """Whether every sequence that runs while `sitting_out` sits out ends within `num_steps` steps (by its
        max_tokens; an earlier stop only ends it sooner). Other tenants' waiting requests count as if they
        started now when there are slots for them all: a short request about to start is not joined by the
        flood's step either (a steady client's 10-step cycle once met a 10-step period, and the flood ran in
        the first step of every one of its requests, adding ~60% to its time to first token)."""
        sitting_tenants = {s.tenant_id for s in self.running if s.seq_id in sitting_out}
        waiting = [s for tenant, queue in self.waiting.items() if tenant not in sitting_tenants for s in queue]
        if sum(map(self.slots_needed, waiting)) > self.max_num_seqs - self.num_slots_taken():
            return False  # some would wait for a slot: they end later than their own length says
        for seq in itertools.chain(self.running, waiting):
            if seq.seq_id in sitting_out:
                continue
            prefill_steps = -(-(seq.num_uncomputed_tokens - 1) // self.max_num_batched_tokens)
            if seq.sampling.max_tokens - seq.num_output_tokens + prefill_steps > num_steps:
                return False
        return True

    def _step_rows(self, allowance_key: str) -> int:
        """The rows a narrowed step runs for `allowance_key` (see _narrow_step_allowance, BatchBesideInteractive)."""
        if allowance_key == BACKGROUND and not self.decode_yield_min_tokens:
            return self.batch.step_rows()
        return CPU_FLOOD_STEP_ROWS

    def _interactive_within_grace(self) -> bool:
        """GPU: whether interactive work runs or waits, or did within the last BATCH_GRACE_STEPS steps. Batch
        work keeps its limits over the gap between one interactive request and the next: without the grace the
        gap's first step admitted a whole wave of batch prompts (576 tokens: 14.5 ms of GPU on Llama-3.1-8B's
        shapes, against 6 ms for the capped step), and the next interactive request, arriving during it, waited
        for it."""
        return self._interactive_work_now() or self.num_steps - self._interactive_seen_step <= BATCH_GRACE_STEPS

    def _interactive_work_now(self) -> bool:
        """Whether interactive work runs or waits this step, noting the step when it does (the graces after
        interactive work count from it)."""
        if not self._has_interactive_work():
            return False
        self._interactive_seen_step = self.num_steps
        return True

    def _has_interactive_work(self) -> bool:
        """Whether interactive (not batch) work runs or waits. On the CPU (decode yielding on) batch work sits
        out every step that has some: there a step costs in proportion to its rows, so batch rows beside an
        interactive request would slow it (a 40-line batch made a short chat request 3-4x slower), and a
        step of batch work alone is kept short (CPU_BATCH_STEP_TOKENS), so an interactive request arriving
        meanwhile waits for little. On a GPU the extra rows of a decode step are nearly free: batch work runs
        beside interactive work there, preempted first."""
        return (any(not s.background for s in self.running)
                or any(not s.background for queue in self.waiting.values() for s in queue))

    # ---- fair sharing -----------------------------------------------------------------------
    def _demand_tenants(self) -> set[str]:
        """Tenants with interactive work running or ready to run: the ones shares are split among."""
        tenants = {s.tenant_id for s in self.running if not s.background}
        for tenant, queue in self.waiting.items():
            if tenant not in tenants and any(not s.background for s in queue):
                tenants.add(tenant)  # readiness is not asked here: asking may start an adapter's load
        return tenants

    def _preempt_for_fairness(self, out: SchedulerOutput) -> None:
        """Make room for the next waiting sequence when its tenant is under its share (or it is interactive
        and batch work runs), preempting from the tenant furthest over its share."""
        for _ in range(MAX_FAIRNESS_PREEMPTIONS_PER_STEP):
            candidate = self._next_waiting()
            if candidate is None:
                return
            short_of_slots = self.num_slots_taken() + self.slots_needed(candidate) > self.max_num_seqs
            short_of_blocks = not short_of_slots and not self._fits(candidate)
            if not (short_of_slots or short_of_blocks):
                return
            demand = self._demand_tenants()
            bm = self.block_manager
            load = fair_share.loads(self.running, bm.pinned_blocks_by_tenant())
            victim = fair_share.pick_victim(
                self.running, candidate, load, self.fair.shares(demand, self.max_num_seqs),
                self.fair.shares(demand, bm.num_blocks), short_of_blocks, self.num_steps)
            if victim is None:
                return
            self._preempt(victim, out, for_fairness=True)

    def _kept_for_newcomers(self, seq: Sequence) -> bool:
        """Whether `seq` would take one of the last `newcomer_reserved_slots` free slots without a right to it.

        Those slots go only to a tenant under its share counted as if one more tenant wanted in. So a tenant
        flooding the engine stops a few slots short of filling it, and another tenant's first request starts at
        the next step without preempting anyone. The engine adds them on top of its `max_num_seqs`
        (`EngineConfig.running_slots`), so the flood still runs `max_num_seqs` sequences. Preempting cost the
        flood more than the slot: on a GPU the preempted sequence's resume is a prefill chunk, so a step that
        replays a decode graph (~3 ms at 64 SmolLM2 rows on an H200) became an eager one (~15 ms), once for each
        short request of another tenant.
        Batch work takes kept slots only while no interactive work runs or waits: an interactive request that
        comes then preempts a batch line (batch work goes first), which resumes in a later admission wave."""
        if self.num_slots_taken() + self.slots_needed(seq) - 1 + self.newcomer_reserved_slots < self.max_num_seqs:
            return False
        if seq.background:
            return self._has_interactive_work()
        demand = self._demand_tenants() | {seq.tenant_id, NEWCOMER}
        share = self.fair.shares(demand, self.max_num_seqs)[seq.tenant_id]
        running = sum(1 for s in self.running if s.tenant_id == seq.tenant_id and not s.background)
        return running + self.slots_needed(seq) > share

    def _fits(self, seq: Sequence) -> bool:
        """Whether `seq`'s first chunk would find blocks now (counting its cached prefix as free to take)."""
        needed = self.block_manager.blocks_needed(min(len(seq.token_ids), self.max_num_batched_tokens))
        return needed <= self.block_manager.num_free_blocks

    def _prefill_caps(self, order: list[Sequence], budget: int, yielding: set[int]) -> dict[str, int] | None:
        """Per-tenant caps on this step's prefill tokens when several tenants want prefill: each its weighted
        share of what the decodes leave; None when no cap is needed."""
        if not self.fair_sharing:
            return None
        decodes = sum(1 for s in order if s.num_uncomputed_tokens == 1 and s.seq_id not in yielding)
        demand: dict[str, int] = {}
        for seq in order:
            if seq.num_uncomputed_tokens > 1:
                demand[seq.tenant_id] = demand.get(seq.tenant_id, 0) + seq.num_uncomputed_tokens
        if self.num_slots_taken() < self.max_num_seqs:
            for tenant, queue in self.waiting.items():
                waiting = next((s for s in queue if not s.background), None)
                if waiting is not None and tenant not in demand:
                    demand[tenant] = waiting.num_uncomputed_tokens
        if len(demand) < 2:
            return None
        return fair_share.prefill_caps(max(0, budget - decodes), demand, self.fair, self.block_manager.block_size)

    def update_from_output(self, scheduled: SchedulerOutput) -> None:
        """Token progress after the step ran: every scheduled sequence computed the tokens it was given, and a
        forked child now owns its blocks. A decode's drafts count once verified (`settle_drafts`)."""
        for seq, num_new in zip(scheduled.seqs, scheduled.num_new_tokens, strict=True):
            seq.num_computed_tokens += num_new - len(seq.spec_token_ids)
            seq.parent = None

    # ---- speculative decoding ---------------------------------------------------------------
    def _draft(self, seq: Sequence, max_tokens: int) -> int:
        """Give a decode its drafts for this step when its blocks have room for them (drafting never evicts a
        pin or preempts anyone); returns how many."""
        drafts = self.speculation.propose(seq, max_tokens) if self.speculation is not None else []
        if drafts and not self.block_manager.can_append(seq, 1 + len(drafts)):
            drafts = []
        seq.spec_token_ids = drafts
        return len(drafts)

    def settle_drafts(self, seq: Sequence, first: int) -> None:
        """After verification appended `seq`'s tokens from position `first` on: the K/V of the accepted drafts
        count as computed, blocks past the tokens are given back at once, the drafts are forgotten. The last
        token stays uncomputed (the next step's input) even when the drafts ran up to it."""
        accepted = num_accepted(seq, first)
        if self.speculation is not None:
            self.speculation.record(seq, len(seq.spec_token_ids), accepted)
        if not seq.is_finished:
            seq.num_computed_tokens = min(first + accepted, len(seq.token_ids) - 1)
            self.block_manager.free_blocks_past(seq, len(seq.token_ids))
        seq.spec_token_ids = []

    def _yielding_decodes(self) -> set[int]:
        """Ids of long decodes that sit out this step for a shorter sequence of another tenant: a running one,
        or one waiting to be admitted (its first chunk then runs without them)."""
        if not self.decode_yield_min_tokens or not self.running:
            return set()
        shortest: dict[str, int] = dict.fromkeys((t for t, queue in self.waiting.items() if queue), 0)
        for seq in self.running:
            shortest[seq.tenant_id] = min(shortest.get(seq.tenant_id, seq.num_output_tokens), seq.num_output_tokens)
        if len(shortest) < 2:
            return set()
        (first_tenant, first), (_, second) = sorted(shortest.items(), key=lambda item: item[1])[:2]
        yielding = set()
        for seq in self.running:
            others = second if seq.tenant_id == first_tenant else first
            if seq.num_uncomputed_tokens == 1 and seq.num_output_tokens >= max(self.decode_yield_min_tokens, 2 * others):
                yielding.add(seq.seq_id)
        return yielding

    def _flooding_tenants(self) -> set[str]:
        """Tenants running many sequences while another tenant runs or waits with few (CPU, with decode
        yielding on): in the steps the long decodes sit out, all of a flooding tenant's work sits out too (its
        young decodes, prefill chunks and admissions), so the few-sequence tenant's steps cost near what they
        cost alone; the flood still runs one step in `yield_period`."""
        if not self.decode_yield_min_tokens or not self.running:
            return set()
        return self._floods()

    def _narrow_step_allowance(self, batch_waits: bool) -> dict[str, set[int]]:
        """CPU: which running sequences of a flooding tenant (by tenant) and of batch work (under BACKGROUND) may
        run this step; {} when nothing is narrowed.

        On the CPU a step costs in proportion to its rows: a whole flood's step (60-odd rows) or a batch's took
        many times a short request's, and another tenant's next request, arriving in the moments between its
        requests, waited for it. So while another tenant has work (in the steps a flood does not sit out) and for
        FLOOD_GRACE_STEPS steps after it had some, a flooding tenant's step runs only its CPU_FLOOD_STEP_ROWS
        sequences with the fewest tokens out (all advance alike), admitting new ones only into what is left of
        that; batch work likewise for FLOOD_GRACE_STEPS steps after interactive work had some (while interactive
        work has some, batch work sits out). Alone for longer, either runs at full width again."""
        if not self.decode_yield_min_tokens or not self.has_work():
            return {}
        narrow = self._floods_beside_recent_tenants()
        if not batch_waits and self.num_steps - self._interactive_seen_step <= FLOOD_GRACE_STEPS:
            narrow.add(BACKGROUND)
        if not narrow:
            return {}
        allowance: dict[str, set[int]] = {key: set() for key in narrow}
        for seq in sorted(self.running, key=lambda s: (s.num_output_tokens, s.seq_id)):
            allowed = allowance.get(_allowance_key(seq))
            if allowed is not None and len(allowed) < CPU_FLOOD_STEP_ROWS:
                allowed.add(seq.seq_id)
        return allowance

    def _floods(self) -> set[str]:
        return fair_share.flooding_tenants(self._work_counts(), FLOOD_MIN_SEQS, FLOOD_RATIO)

    def _work_counts(self, with_waiting: bool = False) -> dict[str, int]:
        """Running sequences per tenant; a tenant whose requests only wait counts as running one, or (with_waiting)
        every tenant's waiting interactive sequences count too (batch work is narrowed on its own)."""
        counts: dict[str, int] = {}
        for seq in self.running:
            counts[seq.tenant_id] = counts.get(seq.tenant_id, 0) + 1
        for tenant, queue in self.waiting.items():
            if not queue:
                continue
            waiting = sum(not s.background for s in queue) if with_waiting else 0
            counts[tenant] = max(1, counts.get(tenant, 0) + waiting)
        return counts

    def _floods_beside_recent_tenants(self) -> set[str]:
        """CPU: the flooding tenants, a tenant that had work within the last FLOOD_GRACE_STEPS steps counting as
        running one. Its next request is likely on its way (a steady client pauses between requests), and it
        should wait for a narrow step, whether the flood was running beside its last request or began after it:
        a flood that starts while the engine idles filled its first steps with dozens of new streams (on a 2-core
        CPU, one step of 36 prefills took 0.66 s, and a request arriving in it waited that long). Steps only
        count while the engine has work, so idle time never ends the grace; it ends after that many steps. Waiting
        sequences count: a flood arriving all at once is narrowed from its first step, admissions included."""
        counts = self._work_counts(with_waiting=True)
        seen = self._tenants_seen_step
        for tenant in counts:
            seen[tenant] = self.num_steps
        for tenant, step in list(seen.items()):
            if self.num_steps - step > FLOOD_GRACE_STEPS:
                del seen[tenant]
            elif tenant not in counts:
                counts[tenant] = 1
        return fair_share.flooding_tenants(counts, FLOOD_MIN_SEQS, FLOOD_RATIO)

    def _floods_sitting_out_for_a_prefill(self) -> set[str]:
        """On a GPU (decode yielding off), the flooding tenants' rows that sit out this step for another tenant.

        Without mixed-step graphs, a step that runs another tenant's interactive prefill: it cannot replay the
        decode graphs, and mixed with a flood's 63 decodes it ran eagerly in ~15 ms (H200, SmolLM2 shapes) against
        ~3 ms for the flood's graph step; that step is the other tenant's time to first token. A flood sits out at
        most `MAX_FLOOD_SIT_OUT_STEPS` steps in a row, so others' long prompts cannot starve it.

        With mixed-step graphs, the step admitting another tenant's short prompt (`flood_sit_out_prompt_tokens`):
        beside the flood's rows it replays a graph of ~63 rows (~3 ms), alone one of its own few rows (~1 ms), and
        that step is the newcomer's time to first token. The flood loses one step per such request, at most one in
        `FLOOD_SHORT_SIT_OUT_EVERY`; a long prompt costs about the same with or without the flood, which joins it."""
        if self.decode_yield_min_tokens or not self.fair_sharing or not self.running:
            return set()
        if self.flood_sit_out_prompt_tokens is not None:
            return self._floods_sitting_out_for_a_short_prompt(self.flood_sit_out_prompt_tokens)
        if self._flood_sit_out_streak >= MAX_FLOOD_SIT_OUT_STEPS:
            self._flood_sit_out_streak = 0
            return set()
        floods = self._floods()
        if floods and self._others_want_prefill(floods):
            self._flood_sit_out_streak += 1
            return floods
        self._flood_sit_out_streak = 0
        return set()

    def _floods_sitting_out_for_a_short_prompt(self, max_prompt_tokens: int) -> set[str]:
        if (max_prompt_tokens <= 0 or self.num_slots_taken() >= self.max_num_seqs
                or self.num_steps - self._last_short_sit_out_step < FLOOD_SHORT_SIT_OUT_EVERY):
            return set()
        floods = self._floods()
        if not floods:
            return set()
        newcomer = self._next_waiting(skip_tenants=floods, skip_background=True)
        if newcomer is None or newcomer.num_uncomputed_tokens > max_prompt_tokens:
            return set()
        self._last_short_sit_out_step = self.num_steps
        return floods

    def _others_want_prefill(self, floods: set[str]) -> bool:
        """Whether a tenant outside `floods` has an interactive prefill chunk to run now: a running one, or
        the request admission would take next (a free slot needed)."""
        if any(s.num_uncomputed_tokens > 1 and not s.background and s.tenant_id not in floods for s in self.running):
            return True
        if self.num_slots_taken() >= self.max_num_seqs:
            return False
        candidate = self._next_waiting(skip_tenants=floods, skip_background=True)
        return candidate is not None

    def _make_room(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Free blocks for `seq`: drop session pins first (oldest first), then preempt the newest."""
        while not self.block_manager.can_append(seq, num_new):
            if self.block_manager.evict_oldest_pin() is not None:
                continue
            victim = self._block_victim()
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _block_victim(self) -> Sequence:
        """Whom to preempt when blocks run out: the newest batch sequence, else (with fair sharing) the newest of
        the tenant holding the most blocks per weight, else the newest running."""
        batch = [s for s in self.running if s.background and s.parent is None]
        if batch:
            return batch[-1]
        if self.fair_sharing and len({s.tenant_id for s in self.running}) > 1:
            load = fair_share.loads(self.running, {})
            tenant = max(load, key=lambda t: load[t].num_blocks / self.fair.weight(t))
            mine = [s for s in self.running if s.tenant_id == tenant and s.parent is None]
            if mine:
                return mine[-1]
        return self.running[-1]

    def _schedule_seq(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> int:
        out.blocks_to_copy.extend(self.block_manager.may_append(seq, num_new))
        out.seqs.append(seq)
        out.num_new_tokens.append(num_new)
        self.tenant_service[seq.tenant_id] = self.tenant_service.get(seq.tenant_id, 0.0) + num_new
        if seq.num_computed_tokens + num_new == len(seq.token_ids):
            self._fork_parents.pop(seq.seq_id, None)
            for child in self.pending_forks.pop(seq.seq_id, []):
                self._fork(seq, child, num_new, out)
        return num_new

    def _fork(self, parent: Sequence, child: Sequence, num_new: int, out: SchedulerOutput) -> None:
        """The child shares every block; its K/V are written by the parent's chunk this step."""
        self.block_manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens + num_new
        child.num_cached_tokens = parent.num_cached_tokens
        child.parent = parent
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        out.seqs.append(child)
        out.num_new_tokens.append(0)

    def _preempt(self, seq: Sequence, out: SchedulerOutput, for_fairness: bool = False) -> None:
        self.running.remove(seq)
        seq.spec_token_ids = []
        if preempt_swap.swap_out(self.block_manager, seq):
            self.num_swapped_out += 1
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.was_preempted = True
        self.waiting.setdefault(seq.tenant_id, deque()).appendleft(seq)
        self.num_preemptions += 1
        if for_fairness:
            self.num_fairness_preemptions += 1
            out.num_fairness_preempted += 1
        else:
            out.num_preempted += 1
        if seq in out.seqs:
            i = out.seqs.index(seq)
            del out.seqs[i], out.num_new_tokens[i]

    def _admit(self, budget: int, out: SchedulerOutput, skip_tenants: set[str] | None = None,
               skip_background: bool = False, tenant_room: dict[str, int] | None = None) -> None:
        """Admit waiting sequences while budget and slots last; `tenant_room`: at most this many more for the
        tenants named."""
        room = dict(tenant_room or {})
        skip = set(skip_tenants or ()) | {t for t, n in room.items() if n <= 0}
        while budget > 0 and self.num_slots_taken() < self.max_num_seqs:
            no_batch_room = room.get(BACKGROUND, 1) <= 0 or self.batch.prefill_chunk(budget) <= 0
            seq = self._next_waiting(skip, skip_background or no_batch_room)
            if seq is None:
                return
            if self.num_slots_taken() + self.slots_needed(seq) > self.max_num_seqs:
                if not self.fair_sharing:
                    return  # its choices wait for room; no one behind it takes the slots meanwhile
                skip |= self._waiting_for_a_wide_request(seq)
                skip_background = True
                continue
            if self._kept_for_newcomers(seq):
                return  # the best candidate may not take a kept slot: no other one would be allowed either
            first_time = seq.num_cached_tokens < 0
            preempt_swap.swap_in(self.block_manager, seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if seq.background and num_new > 1:
                num_new = self.batch.prefill_chunk(num_new)
            while not self.block_manager.can_append(seq, num_new):
                if self.block_manager.evict_oldest_pin() is None:
                    self.block_manager.deallocate(seq)
                    return
            self._take_from_queue(seq)
            if first_time:
                seq.num_cached_tokens = seq.num_computed_tokens
                self.block_manager.num_prefix_queries += seq.num_prompt_tokens
                self.block_manager.num_prefix_hits += seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            if seq.was_preempted:
                seq.was_preempted = False
                seq.protected_until = self.num_steps + fair_share.PROTECT_STEPS
            self.running.append(seq)
            budget -= self._schedule_seq(seq, num_new, out)
            if seq.background and seq.num_uncomputed_tokens > 1:
                self.batch.take_prefill(num_new)
            key = _allowance_key(seq)
            if key in room:
                room[key] -= 1
                if room[key] <= 0 and key != BACKGROUND:
                    skip.add(key)

    def _waiting_for_a_wide_request(self, wide: Sequence) -> set[str]:
        """The tenants that may not take free slots while `wide` (a request of several choices that does not fit
        yet) waits for room: its own, and every tenant at or over its slot share. Fairness preemption frees slots
        for it from tenants over their share; they, their preempted sequences included, would take them back every
        step. Tenants under their share still come in, so a wide request cannot hold a third tenant's request
        behind it while it waits (preemption takes no tenant below its share, so that wait can last until the
        generations running at their shares end)."""
        shares = self.fair.shares(self._demand_tenants() | {wide.tenant_id}, self.max_num_seqs)
        running: dict[str, int] = {}
        for seq in self.running:
            if not seq.background:
                running[seq.tenant_id] = running.get(seq.tenant_id, 0) + 1
        return {wide.tenant_id} | {tenant for tenant in self.waiting
                                   if running.get(tenant, 0) + 1 > shares.get(tenant, 0.0)}

    def _next_waiting(self, skip_tenants: set[str] | None = None, skip_background: bool = False) -> Sequence | None:
        """Interactive work first; then the tenant furthest under its slot share (running over weight), then
        the one with the least recent service per weight; within a tenant by `admission_key`."""
        best: Sequence | None = None
        best_key: tuple[bool, float, float, float] | None = None
        num_running: dict[str, int] = {}
        for seq in self.running:
            if not seq.background:
                num_running[seq.tenant_id] = num_running.get(seq.tenant_id, 0) + 1
        for tenant, queue in self.waiting.items():
            if skip_tenants and tenant in skip_tenants:
                continue
            candidate = self._first_admissible(queue, skip_background)
            if candidate is None:
                continue
            weight = self.fair.weight(tenant)
            service = self.tenant_service.get(tenant, 0.0)
            if self.fair_sharing:
                key = (candidate.background, num_running.get(tenant, 0) / weight, service / weight,
                       candidate.arrival_time)
            else:
                key = (candidate.background, 0.0, service, candidate.arrival_time)
            if best_key is None or key < best_key:
                best, best_key = candidate, key
        return best

    def _first_admissible(self, queue: deque[Sequence], skip_background: bool) -> Sequence | None:
        """A tenant's first sequence in admission order that may run now, stopping at the first ready one:
        asking readiness may start an adapter's load (and evict another's slot), so only the one that would
        be admitted is asked. The front-runner is found without sorting: this runs on every step, and a
        flooding tenant's queue holds hundreds of requests; the sort is only for when it cannot run."""
        if not queue:
            return None
        head = min(queue, key=admission_key)
        if not (skip_background and head.background) and self._is_ready(head):
            return head
        return next((s for s in sorted(queue, key=admission_key)
                     if s is not head and not (skip_background and s.background) and self._is_ready(s)), None)

    def _is_ready(self, seq: Sequence) -> bool:
        if seq.adapter_id is None or self.adapter_ready is None:
            return True
        if seq.seq_id in self.failed:
            return False
        try:
            return self.adapter_ready(seq.adapter_id)
        except Exception as exc:  # e.g. the adapter cannot load: fail this request, not the loop
            self.failed[seq.seq_id] = (seq, exc)
            return False

    def take_failed(self) -> list[tuple[Sequence, Exception]]:
        failed = list(self.failed.values())
        self.failed.clear()
        return failed

    def _take_from_queue(self, seq: Sequence) -> None:
        queue = self.waiting[seq.tenant_id]
        queue.remove(seq)
        if not queue:
            del self.waiting[seq.tenant_id]


def _allowance_key(seq: Sequence) -> str:
    return BACKGROUND if seq.background else seq.tenant_id


def _allowed(seq: Sequence, allowance: dict[str, set[int]]) -> bool:
    """Whether `seq` may run in a step narrowed by `allowance` (see Scheduler._narrow_step_allowance)."""
    allowed = allowance.get(_allowance_key(seq))
    return allowed is None or seq.seq_id in allowed
