"""Verification of a step's drafts: from the logits of each draft row to the tokens the output keeps.

A decode with drafts d0..d(k-1) ran rows for its last token and each draft;
row j's logits score the position after d(j-1). The engine walks the rows in
order, as decoding one token per step would: the sampler picks the token at
the position (`Sampler.verify_token`, with the grammar mask, penalties and
min_tokens of the sequence as it stands, the drafts accepted so far
included), the request state takes it (stop tokens, max_tokens, the grammar's
end all apply as usual), grammar-forced tokens are appended (jump-forward),
and the walk goes on only while every token appended equals the draft at its
place; the token that differs (or the one past the last draft) is the step's
last. Jump-forward tokens that equal the drafts count as accepted and the
walk uses the rows after them. The grammar matcher therefore only ever sees
tokens the output keeps: a draft its grammar refuses is never fed to it (the
mask makes it lose to an allowed token), and there is nothing to roll back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from loraplex.engine.protocol import TokenLogprob
from loraplex.engine.sequence import Sequence

if TYPE_CHECKING:  # the scheduler imports this module, and the input batch imports the scheduler
    from loraplex.engine.input_batch import StepRows
    from loraplex.engine.sampler import Sampler


def split_verified_logits(logits: torch.Tensor, rows: StepRows, result: object) -> torch.Tensor:
    """Take the draft rows' logits (the last ones, engine/input_batch.py) off the step's: a plain greedy
    sequence's argmax per row, taken where the logits are (one batched argmax, a few integers to the host), into
    `result.spec_argmax`; any other sequence's logits to the host, into `result.spec_logits`. Returns the logits
    of the rows sampled as usual."""
    if not rows.verified:
        return logits
    num_sampled = len(rows.sampled) + len(rows.forks)
    verified = logits[num_sampled:]
    greedy = [_is_plain_greedy(seq) for seq, _ in rows.verified]
    spans, start = [], 0
    for _, n in rows.verified:
        spans.append((start, start + n))
        start += n
    argmax = verified[:start].argmax(dim=-1).tolist() if any(greedy) else []
    rest = [i for (first, end), g in zip(spans, greedy, strict=True) if not g for i in range(first, end)]
    host = verified[torch.tensor(rest, device=verified.device)].float().cpu() if rest else None
    taken = 0
    for (seq, n), (first, end), g in zip(rows.verified, spans, greedy, strict=True):
        if g:
            result.spec_argmax[seq.seq_id] = argmax[first:end]  # type: ignore[attr-defined]
        else:
            assert host is not None
            result.spec_logits[seq.seq_id] = host[taken : taken + n]  # type: ignore[attr-defined]
            taken += n
    return logits[:num_sampled]


def verify_drafts(seq: Sequence, logits: torch.Tensor | None, sampler: Sampler,
                  add_token: Callable[[int, TokenLogprob | None], bool], jump_forward: Callable[[], bool],
                  argmax: list[int] | None = None) -> bool:
    """Append the tokens this step gives `seq` (see the module's note); True if the choice finished.
    `logits`: [1 + drafts, vocab], or for a plain greedy sequence `argmax`, each row's argmax, instead;
    `add_token(token, logprob)` and `jump_forward()` are the engine's own, each returning whether the choice
    finished."""
    drafts = seq.spec_token_ids
    first = len(seq.token_ids)  # the position row 0 scores
    if argmax is None and logits is not None and _is_plain_greedy(seq):
        argmax = logits.argmax(dim=-1).tolist()
    row = 0
    while True:
        if argmax is not None:  # a reasoning budget may force tokens mid-walk; nothing else changes a greedy row's
            token, logprob = (seq.forced_token_ids[0] if seq.forced_token_ids else argmax[row]), None
        else:
            assert logits is not None
            token, logprob = sampler.verify_token(logits[row : row + 1], seq, drafts[row] if row < len(drafts) else None)
        if add_token(token, logprob) or jump_forward():
            return True
        produced = seq.token_ids[first:]
        if len(produced) > len(drafts) or produced != drafts[: len(produced)]:
            return False
        row = len(produced)


def _is_plain_greedy(seq: Sequence) -> bool:
    """Greedy with nothing that depends on the tokens before the position (grammar, penalties, a min_tokens ban,
    forced tokens) and no logprobs: every row's token is its argmax, taken for all rows at once."""
    sampling = seq.sampling
    return (seq.matcher is None and (sampling.temperature <= 0 or sampling.top_k == 1) and sampling.logprobs is None
            and not sampling.logit_bias and not seq.forced_token_ids and sampling.repetition_penalty == 1.0
            and not sampling.presence_penalty and not sampling.frequency_penalty
            and (not seq.min_tokens_ban_ids or seq.num_output_tokens >= sampling.min_tokens))


def num_accepted(seq: Sequence, first: int) -> int:
    """Drafts of `seq` that its tokens from position `first` on kept, in order."""
    count = 0
    for token, draft in zip(seq.token_ids[first:], seq.spec_token_ids, strict=False):
        if token != draft:
            break
        count += 1
    return count
