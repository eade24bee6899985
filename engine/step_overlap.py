"""Overlapped scheduling: the host schedules and launches step N+1 while the device runs step N.

Without it, each engine step is schedule -> build inputs -> run -> read the tokens back ->
update outputs, and the device idles through every part but the run. With it, a step that
replays a captured graph (decodes, or prefill chunks beside decodes) and samples on the device
is left in flight: the next `step()` call schedules the following step *ahead* of it, launches
that step (whose in-flight decodes take their input ids from the in-flight step's sampled
tokens, never crossing to the host; new requests' prompt chunks are known), and only then
waits for the in-flight step's tokens and updates the outputs, while the device already
computes. A request arriving meanwhile is admitted into a step launched ahead like any other:
its prompt does not drain the pipeline.

Scheduling ahead: each in-flight sequence counts the tokens its row computes, and one that
samples gets a placeholder token for the token the device is sampling, so the scheduler sees
what it would see after the update; this is taken back once the next step is launched, before
the real update. Outputs are unchanged: every sequence gets the same tokens. A sequence that
finishes at step N has already been scheduled into step N+1; that row is computed and dropped
(its blocks are freed by then, and anything that reuses them runs later on the same stream).

Run ahead only when nothing can change under the placeholders: every in-flight sequence that samples
does so on the device, greedily or drawing at its temperature alone (its uniform for the next position is
drawn when that step launches, the one it would draw when it runs), with no grammar, forced tokens,
logprobs, penalties or min_tokens, nor a thinking budget the token in flight could spend (reasoning markers
alone only count thinking tokens: every chat request carries them); there are blocks for a whole step
beside one more token each (no preemption, no pin eviction) and no forks are pending. Otherwise the
in-flight step is finished first and the step runs as before.

With speculative decoding on, a step scheduled ahead never drafts (its sequences' last tokens are
placeholders), and steps run ahead only while no sequence would draft: once one would (its known tokens
end in an n-gram the proposer can continue, it is not switched off, the step is not compute-bound),
the in-flight step is finished and the next one is scheduled on the real tokens, with its drafts,
and verified after it runs. Under tensor parallelism every rank launches the step and samples the same
greedy tokens from the same gathered logits, so a fed step finds them on each rank's GPU.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from loraplex.engine.protocol import ReasoningMarkers, RequestOutput
from loraplex.engine.sampler import draws_at_random, draws_by_temperature_alone
from loraplex.engine.scheduler import SchedulerOutput
from loraplex.engine.sequence import Sequence

if TYPE_CHECKING:
    from loraplex.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

PLACEHOLDER_TOKEN = 0  # stands for a token still on the device; never read as an input id
OUTCOMES = ("ahead", "launched", "not_plain", "room", "drafts", "not_launchable", "launch_failed")


def _budget_reachable(seq: Sequence, markers: ReasoningMarkers | None) -> bool:
    """Whether the token in flight could spend the sequence's thinking budget, after which its next token is
    forced (the end marker; engine/output/processor.py). Every chat request carries the reasoning markers, to
    count thinking tokens; only a budget makes what comes next depend on the last token."""
    budget = seq.sampling.max_reasoning_tokens
    if markers is None or budget is None:
        return False
    # inside the segment the token counts one; outside, it may complete the start marker, which counts them all
    spent = seq.num_reasoning_tokens + (1 if seq.reasoning_inside else max(1, len(markers.start_token_ids)))
    return spent >= budget


class StepOverlap:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.pending: Any = None  # the runner's in-flight step (PendingStep)
        self.num_steps_ahead = 0  # steps launched ahead of the previous one's tokens
        self.num_prompt_steps_ahead = 0  # of those, steps with prompt chunks (new requests admitted, or chunks)
        self.num_rows_dropped = 0  # rows computed for a sequence that finished the step before
        self.last_step_was_idle = False  # work is waiting but nothing could run (the engine reports it)
        # For operators (`loraplex_engine_overlap_steps_total{outcome}`). Each step counts once, by how it ran:
        # `ahead` (launched before the previous step's tokens reached the host), `launched` (left in flight with
        # nothing in flight before it), `not_launchable` (run at once: no captured graph for its shape, a row
        # sampled on the host, a preemption) or `launch_failed`. Each time the host waited for the step in
        # flight before scheduling the next also counts, by why: `not_plain` (a row in flight samples with a
        # grammar, penalties, logprobs, a thinking budget about to run out...), `room` (too few free blocks to
        # schedule ahead safely, or a fork or swap pending), `drafts` (a sequence would draft).
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)

    @classmethod
    def for_engine(cls, engine: LLMEngine) -> StepOverlap | None:
        if not engine.config.resolve_overlap_scheduling():
            return None
        return cls(engine)

    # ---- the loop body --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        engine = self.engine
        outputs: list[RequestOutput] = []
        pending, self.pending = self.pending, None
        waited_for = self._why_not_ahead(pending) if pending is not None else None
        if waited_for is not None:
            self.outcomes[waited_for] += 1
            outputs += self._complete(pending)
            pending = None
        advanced = self._advance(pending) if pending is not None else []
        fed = {seq.seq_id for seq, _, sampled in advanced if sampled}
        try:
            scheduled = engine.scheduler.schedule(drafts=pending is None)
        except BaseException:
            self._retreat(advanced)
            raise
        outputs += engine.fail_unready()
        if scheduled.is_empty or (pending is None and not self._launchable(scheduled, fed)):
            self._retreat(advanced)
            if pending is not None:
                outputs += self._complete(pending)
            self.last_step_was_idle = scheduled.is_empty and not outputs
            if scheduled.is_empty:
                return outputs
            self.outcomes["not_launchable"] += 1
            return outputs + self._run_now(scheduled)
        self.last_step_was_idle = False
        if pending is not None and not self._launchable(scheduled, fed):
            # What the scheduler chose ahead of the in-flight step cannot be left in flight (a preemption, a
            # row sampled on the host or with a grammar): finish that step, then run this one as usual (the
            # placeholders it was scheduled on are the real tokens by then).
            self._retreat(advanced)
            outputs += self._complete(pending)
            self.outcomes["not_launchable"] += 1
            return outputs + self._run_now(self._live(scheduled))
        try:
            launched = engine.runner.launch(scheduled, feed=pending)
        except Exception:
            # Run it again on its own, where a failing row is found and fails alone (engine/step_isolation.py).
            self._retreat(advanced)
            logger.exception("launching a step ahead failed; running it on its own")
            self.outcomes["launch_failed"] += 1
            if pending is not None:
                outputs += self._complete(pending)
            return outputs + self._run_now(self._live(scheduled))
        self._retreat(advanced)
        self.outcomes["ahead" if pending is not None else "launched"] += 1
        if pending is not None:
            self.num_steps_ahead += 1
            self.num_prompt_steps_ahead += any(seq.seq_id not in fed for seq in scheduled.seqs)
            outputs += self._complete(pending)
        self.pending = launched
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Finish the in-flight step, if any (before anything that needs every token on the host)."""
        pending, self.pending = self.pending, None
        return self._complete(pending) if pending is not None else []

    # ---- pieces ---------------------------------------------------------------------------
    def _run_now(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        """A step run start to finish (prefill chunks, mixed steps, host-sampled rows)."""
        return self.engine.run_scheduled(scheduled) if not scheduled.is_empty else []

    def _complete(self, pending: Any) -> list[RequestOutput]:
        engine = self.engine
        result = engine.runner.collect(pending)
        live = self._live(pending.scheduled)
        self.num_rows_dropped += len(pending.scheduled.seqs) - len(live.seqs)
        return engine.apply_step_result(live, result)

    def _live(self, scheduled: SchedulerOutput) -> SchedulerOutput:
        """The step's rows whose request is still alive and whose sequence has not finished (a row
        scheduled ahead for a sequence that finished meanwhile, or one aborted, is dropped)."""
        requests = self.engine.requests
        keep = [(s, n) for s, n in zip(scheduled.seqs, scheduled.num_new_tokens, strict=True)
                if s.request_id in requests and not s.is_finished]
        if len(keep) == len(scheduled.seqs):
            return scheduled
        return SchedulerOutput([s for s, _ in keep], [n for _, n in keep], scheduled.blocks_to_copy,
                               scheduled.num_preempted)

    def _launchable(self, scheduled: SchedulerOutput, fed: set[int]) -> bool:
        """Whether the runner can leave this step in flight: no preemption or swap, and a sequence carrying a
        placeholder (`fed`) only as a one-token decode, whose input the device takes from the step in flight."""
        host_tier = self.engine.host_tier
        return (not scheduled.num_preempted and not scheduled.num_fairness_preempted
                and not (host_tier is not None and host_tier.swaps)
                and not any(n != 1 and s.seq_id in fed for s, n in zip(scheduled.seqs, scheduled.num_new_tokens,
                                                                         strict=True))
                and self.engine.runner.can_launch(scheduled))

    def _why_not_ahead(self, pending: Any) -> str | None:
        """None when the next step may be scheduled and launched while `pending` runs; else the outcome that
        names why not (see `outcomes`)."""
        engine = self.engine
        scheduler = engine.scheduler
        running = scheduler.running
        bm = engine.block_manager
        # Room for any step beside one more token for each sequence: scheduling ahead never preempts for blocks.
        if (scheduler.pending_forks
                or bm.num_free_blocks < len(running) + bm.blocks_needed(scheduler.max_num_batched_tokens)
                or (engine.host_tier is not None and engine.host_tier.swaps)):
            return "room"
        requests = engine.requests
        for seq, num_new in zip(pending.scheduled.seqs, pending.scheduled.num_new_tokens, strict=True):
            if seq.is_finished or seq.request_id not in requests:
                continue
            if seq.num_computed_tokens + num_new == len(seq.token_ids) and not (
                    self._plain(seq) and len(seq.token_ids) + 2 <= engine.max_model_len):
                return "not_plain"  # it samples in flight, and what comes next depends on that token
        if engine.speculation is not None and engine.speculation.may_draft(running):
            return "drafts"
        return None

    def _plain(self, seq: Sequence) -> bool:
        """Decodes on the device (greedily, or drawing at its temperature alone from its own uniforms), and
        nothing about its next token depends on the last one."""
        state = self.engine.requests.get(seq.request_id)
        sampling = seq.sampling
        return (state is not None and len(state.choices) == 1 and seq.matcher is None and not seq.forced_token_ids
                and not _budget_reachable(seq, state.request.reasoning) and not seq.wants_prompt_logprobs
                and not seq.min_tokens_ban_ids and sampling.logprobs is None
                and (not draws_at_random(seq) or draws_by_temperature_alone(seq))
                and not (sampling.presence_penalty or sampling.frequency_penalty or sampling.logit_bias)
                and sampling.repetition_penalty == 1.0)

    @staticmethod
    def _advance(pending: Any) -> list[tuple[Sequence, int, bool]]:
        """Count every in-flight sequence's row as computed, and give one that samples the token its step is
        sampling, as a placeholder; returns (sequence, tokens counted, placeholder given) to take back."""
        advanced = []
        for seq, num_new in zip(pending.scheduled.seqs, pending.scheduled.num_new_tokens, strict=True):
            if seq.is_finished:
                continue
            sampled = seq.num_computed_tokens + num_new == len(seq.token_ids)
            seq.num_computed_tokens += num_new
            if sampled:
                seq.token_ids.append(PLACEHOLDER_TOKEN)
            advanced.append((seq, num_new, sampled))
        return advanced

    @staticmethod
    def _retreat(advanced: list[tuple[Sequence, int, bool]]) -> None:
        for seq, num_new, sampled in advanced:
            if sampled:
                seq.token_ids.pop()
            seq.num_computed_tokens -= num_new
