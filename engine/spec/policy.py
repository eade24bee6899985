"""Where to draft: the `speculative_decoding` mode, per-sequence eligibility and the adaptive switch-offs.

Modes: `off` (nothing changes), `ngram` (every eligible decode drafts with the
n-gram proposer) and `auto` (the same, adaptive). Adaptive, a sequence whose
draft was rejected whole drafts only the proposer's surest guesses for a
while; one whose drafts are mostly rejected stops drafting for a while (the
verification rows cost compute and yield nothing), with the pause doubling
each time it happens again; and a step stops drafting altogether when its
decodes are many enough that the step is compute-bound: there a draft row
costs about what a token of another sequence does, so rejected drafts slow
everyone and even accepted ones gain little. Where steps run ahead of the
host (overlapped scheduling), a step of more than a few decodes does not
draft either: a step with drafts cannot run ahead, which costs more than its
accepted drafts gain.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engine.sequence import Sequence
from loraplex.engine.spec.proposer import PROPOSERS, Proposer

MODES = ("off", "ngram", "auto")
MIN_ACCEPTANCE = 0.25     # below this moving share of accepted drafts, a sequence stops drafting for a while
ACCEPTANCE_WEIGHT = 0.3   # weight of the latest verification in that moving share
FIRST_COOLDOWN, MAX_COOLDOWN = 16, 256  # output tokens a switch-off lasts, doubling from the first up to the last
# After a draft rejected whole, a sequence drafts only the proposer's surest guesses (the n-gram proposer: matches
# of 3 tokens or more) for this many output tokens. Most drafts rejected whole came from 2-token matches (SmolLM2-
# 135M, batch 8: 2-token matches had 0-24% of their drafts accepted on code editing and open chat, longer ones
# 62-100%), and where steps run ahead of the host a verification step at batch 1 took an H200 ~1.6 ms against
# 0.79 ms for a decode step. On 24 prompts outside the benchmark (batch 1, CPU) it cut `auto`'s verifications by
# 1-13% for -1% to +4% steps.
CAUTIOUS_TOKENS = 64
# Decode rows times (1 + drafts) past which a step is compute-bound: the CPU's matrix products stop being
# bound by reading the weights after a few dozen rows; a GPU's after a few hundred.
COMPUTE_BOUND_TOKENS = {"cpu": 32, "cuda": 256}
# With overlapped scheduling, `auto` drafts only in steps of at most this many decodes. A step with drafts cannot
# be launched ahead (the host verifies it before the next is scheduled), so drafting trades the run-ahead's hidden
# host time for the accepted tokens, and that pays only where a step is one or a few rows: on an H200 (SmolLM2,
# overlap on) batch 1 ran 1.45-1.92x with drafts on the input-grounded tasks, while at batch 8 drafts accepted 80%
# of the time gained nothing (1.00x) and 58% lost 22%, and at batch 64 drafting rows lost 23-36%.
OVERLAP_MAX_DRAFTING_DECODES = 4
# `auto` never drafts a grammar-constrained sequence: the grammar's jump-forward already takes the text it forces
# (keys, punctuation), so what is left to guess is the free values, and the benchmark's JSON drafts were accepted
# 12% of the time, on the CPU and a GPU alike. A verification row costs ~1.6x a decode row on the CPU (0.82-0.97x
# of `off` at batch 1 and 64 with `ngram`); on a GPU a grammar row's drafts also need its logits on the host and
# the grammar's mask at each position after the step, ~2 ms a verification on an H100 against a 1.2 ms step
# (0.6-0.8x). `ngram` drafts them everywhere.

@dataclass(slots=True)
class SpeculationConfig:
    mode: str = "off"
    num_tokens: int = 4          # k: draft tokens per sequence and step
    ngram_min: int = 2
    ngram_max: int = 4
    device_type: str = "cpu"
    max_model_len: int = 2048    # drafts never reach past the context
    overlapped: bool = False     # steps without drafts are launched ahead (set by the engine that runs them)

    @property
    def drafts(self) -> bool:
        """Whether steps may carry drafts at all."""
        return self.mode != "off"

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"speculative_decoding must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.num_tokens < 1:
            raise ValueError("speculative_num_tokens must be at least 1")


class Speculation:
    """Proposes each step's drafts and keeps the counts of drafted and accepted tokens."""

    def __init__(self, config: SpeculationConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.adaptive = config.mode == "auto"
        self.compute_bound_tokens = COMPUTE_BOUND_TOKENS.get(config.device_type, COMPUTE_BOUND_TOKENS["cuda"])
        self.num_draft_tokens = 0      # proposed and verified
        self.num_accepted_tokens = 0   # of those, the ones the output kept
        self.num_verified_rows = 0
        self.num_skipped_steps = 0     # steps that drafted nothing because they were compute-bound
        # Per draft position (0: the first draft): drafts verified there, and those the output kept. vLLM's
        # acceptance per position divides the latter by verified rows; ours may draft fewer than k tokens.
        self.num_draft_tokens_per_pos = [0] * config.num_tokens
        self.num_accepted_tokens_per_pos = [0] * config.num_tokens

    @classmethod
    def from_config(cls, config: SpeculationConfig) -> Speculation | None:
        config.validate()
        if not config.drafts:
            return None
        return cls(config, PROPOSERS["ngram"](config.ngram_min, config.ngram_max))

    # ---- scheduling -----------------------------------------------------------------------
    def allows_step(self, num_decodes: int) -> bool:
        """Whether this step drafts at all (adaptive: not once its decodes make it compute-bound)."""
        if self._step_allowed(num_decodes):
            return True
        self.num_skipped_steps += 1
        return False

    def _step_allowed(self, num_decodes: int) -> bool:
        if not self.adaptive:
            return True
        if self.config.overlapped and num_decodes > OVERLAP_MAX_DRAFTING_DECODES:
            return False
        return num_decodes * (1 + self.config.num_tokens) <= self.compute_bound_tokens

    def may_draft(self, running: list[Sequence]) -> bool:
        """Whether a step of these decodes would likely carry drafts: one of them may draft and the proposer
        continues the tokens it has (a step still in flight holds its newest). Overlapped scheduling runs steps
        ahead only while none would."""
        return self._step_allowed(len(running)) and any(
            self._may_draft_for(seq) and self._proposal(seq, 1) for seq in running)

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Drafts for a decode of `seq`, at most `max_tokens` (the step's budget left past its own token)."""
        if not self._eligible(seq):
            return []
        # The output's room left, less the token the verification samples past the drafts.
        room = min(seq.sampling.max_tokens - seq.num_output_tokens, self.config.max_model_len - len(seq.token_ids))
        limit = min(self.config.num_tokens, max_tokens, room - 1)
        return self._proposal(seq, limit) if limit > 0 else []

    def _proposal(self, seq: Sequence, max_tokens: int) -> list[int]:
        if seq.spec_state is None:
            seq.spec_state = self.proposer.new_state()
        cautious = self.adaptive and seq.num_output_tokens < seq.spec_cautious_until
        return self.proposer.propose(seq.token_ids, max_tokens, seq.spec_state, cautious)

    def _eligible(self, seq: Sequence) -> bool:
        """A decode on its own blocks with nothing forced: a fork child still shares its parent's last block,
        prompt logprobs want prefill rows, and a forced reasoning end leaves nothing to guess."""
        return seq.num_uncomputed_tokens == 1 and self._may_draft_for(seq)

    def _may_draft_for(self, seq: Sequence) -> bool:
        """Not a seeded random row: whether it gets drafts depends on its batch mates (the step's budget, free
        blocks), and a draft changes which token its uniform picks, so its tokens would no longer depend on its
        seed alone. Nor, with `auto`, a grammar row; nor a sequence switched off."""
        sampling = seq.sampling
        seeded_random = sampling.seed is not None and sampling.temperature > 0 and sampling.top_k != 1
        adaptive_grammar = self.adaptive and seq.matcher is not None
        return (seq.parent is None and not seq.wants_prompt_logprobs and not seq.forced_token_ids
                and seq.num_output_tokens >= seq.spec_resume_at and not seeded_random and not adaptive_grammar)

    # ---- after verification ---------------------------------------------------------------
    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_verified_rows += 1
        for pos in range(num_drafts):
            self.num_draft_tokens_per_pos[pos] += 1
        for pos in range(num_accepted):  # accepted drafts are a prefix of the drafts
            self.num_accepted_tokens_per_pos[pos] += 1
        if not self.adaptive:
            return
        if num_accepted == 0:
            seq.spec_cautious_until = seq.num_output_tokens + CAUTIOUS_TOKENS
        rate = num_accepted / num_drafts
        seq.spec_acceptance = (1 - ACCEPTANCE_WEIGHT) * seq.spec_acceptance + ACCEPTANCE_WEIGHT * rate
        if seq.spec_acceptance < MIN_ACCEPTANCE:
            seq.spec_cooldown = min(MAX_COOLDOWN, 2 * seq.spec_cooldown) if seq.spec_cooldown else FIRST_COOLDOWN
            seq.spec_resume_at = seq.num_output_tokens + seq.spec_cooldown
            seq.spec_acceptance = 2 * MIN_ACCEPTANCE  # the retry starts from a fair chance, not the old average

    def stats(self) -> dict[str, int | list[int]]:
        return {"spec_decode_num_draft_tokens_total": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens_total": self.num_accepted_tokens,
                "spec_decode_num_verified_rows_total": self.num_verified_rows,
                "spec_decode_num_draft_tokens_per_pos": list(self.num_draft_tokens_per_pos),
                "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos)}

    @staticmethod
    def empty_stats() -> dict[str, int | list[int]]:
        """The same counters where speculation is off (no draft positions)."""
        return {"spec_decode_num_draft_tokens_total": 0, "spec_decode_num_accepted_tokens_total": 0,
                "spec_decode_num_verified_rows_total": 0, "spec_decode_num_draft_tokens_per_pos": [],
                "spec_decode_num_accepted_tokens_per_pos": []}
