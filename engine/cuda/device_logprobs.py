"""The logprobs a request asks for (`logprobs`, `top_logprobs`), computed where the logits are.

They are the raw model distribution's, before grammar masks, penalties, bias
and temperature, as the host sampler reports them. A row asking for them used
to take the host sampler, which brought its logits to the host and ran the
log-softmax and a top-k over the vocabulary there: a tenant's 64 streams with
`top_logprobs: 5` made each step ~58 ms on an H200 (SmolLM2 shapes) against
~3 ms, and another tenant's first token wait 25x its quiet time. Now the
log-softmax and the top-k run on the GPU and a few numbers a row come back.
"""

from __future__ import annotations

import torch
from loraplex.engine.device_values import to_device
from loraplex.engine.protocol import TokenLogprob
from loraplex.engine.sequence import Sequence


class DeviceLogprobs:
    """Rows `rows` of a step's logits: their log-softmax and top-k, queued on the GPU when made (before the grammar
    mask changes the logits in place); `entries` reads them once the step's tokens are known."""

    def __init__(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        self.ks = [seqs[i].sampling.logprobs or 0 for i in rows]
        self.raw = torch.log_softmax(logits[to_device(rows, torch.long, logits.device)].float(), dim=-1)
        k = max(self.ks)
        self.top = self.raw.topk(k, dim=-1) if k else None

    def entries(self, tokens: list[int]) -> list[TokenLogprob]:
        """Each row's entry for the token it took (`tokens[j]` for the j-th row)."""
        chosen = self.raw.gather(1, to_device(tokens, torch.long, self.raw.device).unsqueeze(1)).squeeze(1).tolist()
        values, ids = (self.top[0].tolist(), self.top[1].tolist()) if self.top is not None else ([], [])
        return [TokenLogprob(token_id=token, logprob=logprob,
                             top=list(zip(ids[j][:k], values[j][:k], strict=True)) if k else [])
                for j, (token, logprob, k) in enumerate(zip(tokens, chosen, self.ks, strict=True))]
