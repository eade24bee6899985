"""Repetition, frequency and presence penalties, from what each sequence keeps between its steps.

A row's penalties need the tokens its sequence holds (prompt and output: the
repetition penalty) and how often each came out (output: the frequency and
presence penalties). They used to be made from the token list at every step
and applied to whole stacked vocabulary rows: on the host, in the step every
tenant's rows wait for, 64 penalised rows of 2,000-token prompts took
~120 ms a step on a 2-core box (~280 ms at 32,000 tokens), against ~100 ms
for the model's whole decode step there and ~1 ms on a GPU. Now a sequence
with a penalty keeps which tokens it holds and their output counts
(vocabulary-sized: 5 bytes an entry, 250 KB at SmolLM2's 49,152), adds only
the tokens since its last step, and a row's logits change only at those
tokens: a step's cost follows the tokens a sequence holds, not its length.
"""

from __future__ import annotations

import torch
from loraplex.engine.sequence import Sequence


class PenaltyState:
    """Which tokens a sequence holds and how often each came out, over its first `num_counted` tokens."""

    __slots__ = ("counts", "num_counted", "output_ids", "seen", "seen_ids")

    def __init__(self, vocab_size: int) -> None:
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # in the prompt or the output
        self.counts = torch.zeros(vocab_size)                   # times in the output
        self._forget()

    def _forget(self) -> None:
        self.seen.zero_()
        self.counts.zero_()
        self.seen_ids = torch.zeros(0, dtype=torch.long)        # the tokens `seen` marks, each once
        self.output_ids = torch.zeros(0, dtype=torch.long)      # the tokens with a count, each once
        self.num_counted = 0

    def update(self, seq: Sequence) -> None:
        tokens = seq.token_ids
        if len(tokens) < self.num_counted:  # tokens taken back (nothing penalised does that today): count afresh
            self._forget()
        if len(tokens) == self.num_counted:
            return
        last = self.seen.shape[0] - 1
        new = torch.tensor(tokens[self.num_counted :], dtype=torch.long).clamp_(max=last)
        fresh = new[~self.seen[new]]
        if len(fresh):
            self.seen[fresh] = True
            self.seen_ids = torch.cat((self.seen_ids, fresh.unique()))
        first_output = max(self.num_counted, seq.num_prompt_tokens) - self.num_counted
        if first_output < len(new):
            ids = new[first_output:]
            fresh = ids[self.counts[ids] == 0]
            if len(fresh):
                self.output_ids = torch.cat((self.output_ids, fresh.unique()))
            self.counts.index_add_(0, ids, torch.ones(len(ids)))
        self.num_counted = len(tokens)


def has_penalties(seq: Sequence) -> bool:
    sampling = seq.sampling
    return bool(sampling.presence_penalty or sampling.frequency_penalty or sampling.repetition_penalty != 1.0)


def penalty_state(seq: Sequence, vocab_size: int) -> PenaltyState:
    """`seq`'s state, brought up to its tokens (made at its first penalised step)."""
    state = seq.penalty_state
    if state is None or state.seen.shape[0] != vocab_size:
        state = seq.penalty_state = PenaltyState(vocab_size)
    state.update(seq)
    return state


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place on float32 `logits` ([rows, vocab], row i for seqs[i]): the repetition penalty divides a held
    token's positive logit and multiplies a negative one; then the frequency penalty times its output count and
    the presence penalty, once, are subtracted from each token the output holds. Every row's tokens are changed
    by one gather and one scatter over the flattened logits."""
    vocab = logits.shape[-1]
    held: list[torch.Tensor] = []        # flat positions of held tokens, rows with a repetition penalty
    held_factors: list[float] = []
    held_sizes: list[int] = []
    output: list[torch.Tensor] = []      # flat positions of output tokens, rows with a frequency or presence one
    output_counts: list[torch.Tensor] = []
    output_terms: list[tuple[float, float]] = []
    output_sizes: list[int] = []
    for i, seq in enumerate(seqs):
        if not has_penalties(seq):
            continue
        state, sampling = penalty_state(seq, vocab), seq.sampling
        if sampling.repetition_penalty != 1.0:
            ids = state.seen_ids
            held.append(ids + i * vocab)
            held_factors.append(sampling.repetition_penalty)
            held_sizes.append(len(ids))
        if sampling.frequency_penalty or sampling.presence_penalty:
            ids = state.output_ids
            output.append(ids + i * vocab)
            output_counts.append(state.counts[ids])
            output_terms.append((sampling.frequency_penalty, sampling.presence_penalty))
            output_sizes.append(len(ids))
    flat = logits.view(-1)
    if held:
        at = torch.cat(held)
        factor = torch.tensor(held_factors).repeat_interleave(torch.tensor(held_sizes))
        values = flat[at]
        flat[at] = torch.where(values > 0, values / factor, values * factor)
    if output:
        at = torch.cat(output)
        sizes = torch.tensor(output_sizes)
        frequency, presence = torch.tensor(output_terms).repeat_interleave(sizes, dim=0).unbind(1)
        flat[at] = flat[at] - frequency * torch.cat(output_counts) - presence
