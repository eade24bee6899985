"""Top-k and top-p truncation of a batch of logits, without sorting the whole vocabulary where it can be avoided.

A full sort of a 49,152-token row costs ~6 ms on a host core (100 ms for 16 rows), and every row that samples on
the host (penalties, `logit_bias`, `min_tokens`) with a top-k or top-p paid it at every step, holding up the step
for the whole batch. Top-k needs only the k best values. Top-p needs only the best tokens that hold the nucleus,
and for a trained model's distribution the best `_NUCLEUS_CANDIDATES` nearly always do; a host row whose nucleus
does not fit among them (a flat distribution, a high temperature) is sorted as before. On a GPU the sort is cheap
and choosing rows to sort would make the host wait for the forward, so every row is sorted there. The tokens kept
are those a full sort keeps (ties at the boundary fall either way, as they did: the sort is not stable).
"""

from __future__ import annotations

import torch
from loraplex.engine.device_values import to_device

_NUCLEUS_CANDIDATES = 1024


def mask_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """`logits` ([rows, vocab]) with all but each row's k best set to -inf (k <= 0 or >= vocab: left whole)."""
    vocab = logits.shape[-1]
    cut = [k if 0 < k < vocab else 0 for k in top_ks]
    if not any(cut):
        return logits
    best = logits.topk(max(cut), dim=-1).values
    at = to_device([max(k, 1) - 1 for k in cut], torch.long, logits.device).unsqueeze(1)
    kth = best.gather(1, at)
    whole = to_device([k == 0 for k in cut], torch.bool, logits.device).unsqueeze(1)
    return logits.masked_fill((logits < kth) & ~whole, float("-inf"))


def mask_top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """`logits` ([rows, vocab]) with each row's tokens outside its nucleus set to -inf: a token is dropped when the
    tokens ranked above it already hold `top_p` of the probability (top_p >= 1: the row is left whole)."""
    if all(p >= 1.0 for p in top_ps):
        return logits
    # A row without top-p keeps every token: above 1, no mass reaches its threshold (at 1 the tail's rounding might).
    ps = to_device([p if p < 1.0 else 2.0 for p in top_ps], torch.float32, logits.device).unsqueeze(1)
    if logits.device.type != "cpu" or logits.shape[-1] <= _NUCLEUS_CANDIDATES:
        return logits.masked_fill(~_nucleus_by_sort(logits, ps), float("-inf"))
    values, order = logits.topk(_NUCLEUS_CANDIDATES, dim=-1)
    share = torch.exp(values.logsumexp(dim=-1, keepdim=True) - logits.logsumexp(dim=-1, keepdim=True))
    probs = values.softmax(dim=-1) * share
    before = probs.cumsum(dim=-1) - probs  # the mass strictly above each candidate
    kept = (ps > 1.0).expand_as(logits).clone().scatter_(1, order, before < ps)
    # Settled where the last candidate is dropped: every token ranked below it is dropped too.
    unsettled = ((before[:, -1] < ps[:, 0]) & (ps[:, 0] < 1.0)).nonzero().squeeze(1)
    if unsettled.numel():
        kept[unsettled] = _nucleus_by_sort(logits[unsettled], ps[unsettled])
    return logits.masked_fill(~kept, float("-inf"))


def _nucleus_by_sort(logits: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """Which tokens each row keeps, from a full sort of the row."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs_sorted = sorted_logits.softmax(dim=-1)
    before = probs_sorted.cumsum(dim=-1) - probs_sorted
    return torch.zeros_like(logits, dtype=torch.bool).scatter_(1, order, before < ps)
