"""One choice of one request, as the scheduler and block manager see it."""

from __future__ import annotations

import itertools
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import random

    from loraplex.engine.interfaces import GrammarMatcher
    from loraplex.engine.kv.block_manager import CacheSalt
    from loraplex.engine.protocol import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_seq_counter = itertools.count()


class Sequence:
    """Token ids (prompt then output), progress of their K/V, and the block table.

    A sequence "needs a token" when all of its tokens have K/V computed: then
    the step that computed the last of them samples the next one.
    """

    __slots__ = (
        "adapter_id",
        "arrival_time",
        "background",
        "bias_tensors",
        "block_hashes",
        "block_table",
        "drawn_at",
        "drawn_value",
        "forced_token_ids",
        "generator",
        "index",
        "matcher",
        "min_tokens_ban_ids",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_prompt_tokens",
        "num_reasoning_tokens",
        "parent",
        "penalty_state",
        "priority",
        "protected_until",
        "reasoning_inside",
        "request_id",
        "salt",
        "sampling",
        "seq_id",
        "spec_acceptance",
        "spec_cautious_until",
        "spec_cooldown",
        "spec_resume_at",
        "spec_state",
        "spec_token_ids",
        "status",
        "tenant_id",
        "token_ids",
        "wants_prompt_logprobs",
        "was_preempted",
    )

    def __init__(
        self,
        request_id: str,
        index: int,
        token_ids: list[int],
        sampling: SamplingParams,
        tenant_id: str,
        adapter_id: str | None,
        salt: CacheSalt,
        arrival_time: float,
    ) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served from the cache; -1 until first scheduled
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.status = SequenceStatus.WAITING
        self.sampling = sampling
        self.tenant_id = tenant_id
        self.adapter_id = adapter_id
        self.salt = salt
        self.arrival_time = arrival_time
        self.generator: random.Random | None = None  # a random row's uniforms (engine/sampler.py)
        self.matcher: GrammarMatcher | None = None
        self.min_tokens_ban_ids: list[int] = []  # tokens that would end it, masked until sampling.min_tokens
        self.forced_token_ids: list[int] = []
        self.num_reasoning_tokens = 0
        self.reasoning_inside = False
        self.parent: Sequence | None = None  # set on a fork child until its parent's prefill ends
        self.wants_prompt_logprobs = False
        self.bias_tensors: tuple[Any, Any] | None = None  # its logit_bias as (token ids, biases) tensors
        self.penalty_state: Any = None  # its tokens' presence and output counts, for penalties (engine/penalties.py)
        self.priority = 0          # within its tenant, lower runs first
        self.background = False    # batch work: runs on capacity interactive work leaves
        self.protected_until = 0   # scheduler step before which fairness does not preempt it again
        self.was_preempted = False
        self.drawn_at = -1         # the position whose random draw `drawn_value` is (a retried step reuses it)
        self.drawn_value = 0.0
        # Speculative decoding (engine/spec): the draft tokens scheduled after the last token this step, and
        # the adaptive state that turns drafting off for a while where drafts are mostly rejected.
        self.spec_token_ids: list[int] = []
        self.spec_acceptance = 1.0  # moving average of the share of draft tokens accepted
        self.spec_resume_at = 0     # no drafts before this many output tokens
        self.spec_cooldown = 0      # output tokens the next switch-off lasts (doubles each time)
        self.spec_cautious_until = 0  # before this many output tokens, only the proposer's surest drafts
        self.spec_state: Any = None  # the proposer's own memory of this sequence, made at its first proposal

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        extra: Any = (self.request_id, self.index, len(self.token_ids), self.num_computed_tokens)
        return f"Sequence{extra}"
