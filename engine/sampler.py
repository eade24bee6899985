"""From logits to tokens: grammar mask, penalties, temperature/top-k/top-p/min-p, seeded draws.

Every random row draws from its own generator (a `random.Random`: one uniform per position, and asking
a `torch.Generator` for each cost ~3 us a row a step), so a seeded request's tokens do not depend on its
batch mates. Logprobs are those of the model's raw distribution.
"""

from __future__ import annotations

import random
import sys
from typing import TYPE_CHECKING

import numpy as np
import torch
from loraplex.engine.device_values import to_device
from loraplex.engine.penalties import apply_penalties
from loraplex.engine.protocol import TokenLogprob
from loraplex.engine.sequence import Sequence
from loraplex.engine.truncation import mask_top_k, mask_top_p

if TYPE_CHECKING:
    from loraplex.engine.runner import StepResult

_BIT_POSITIONS = torch.arange(32, dtype=torch.int32)


def new_generator(seed: int | None, choice_index: int) -> random.Random:
    if seed is None:
        seed = random.getrandbits(62)
    elif choice_index:
        seed = hash((seed, choice_index)) & ((1 << 62) - 1)
    return random.Random(seed)


# The largest float32 below 1: a uniform must stay below 1 once it is a float32 (a double within 2^-25 of 1
# would round up to it, and a draw at the very top of the CDF can land on a masked token)
MAX_UNIFORM = float(np.nextafter(np.float32(1.0), np.float32(0.0)))


def next_uniform(generator: random.Random | None) -> float:
    """The generator's next uniform in [0, 1) as the draw uses it (float32-safe); None: the process's own."""
    return min(generator.random() if generator is not None else random.random(), MAX_UNIFORM)


_NEG_INF_BITS = int(np.array(-np.inf, dtype=np.float32).view(np.int32))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set logits of tokens whose bit is 0 to -inf (xgrammar packing: bit j of word i = token 32i+j).

    On the CPU (float32, the sampler's case) without branches or threads: the bits are unpacked with
    numpy, and each logit's bit pattern is kept (allowed) or replaced by -inf's with bitwise and/or, so
    the result is bit for bit that of `masked_fill_`. `masked_fill_` branches per element, which a mixed
    mask makes slow, and torch's two-thread elementwise ops stall on a busy host: 16 rows of SmolLM2's
    49152 tokens took 40-65 ms that way, well under 1 ms this way.
    """
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.requires_grad or sys.byteorder != "little" or logits.stride(-1) != 1):
        _apply_token_bitmask_unpacked(logits, bitmask)
        return
    vocab = logits.shape[1]
    bits = logits.numpy().view(np.int32)
    words = bitmask.to(device="cpu", dtype=torch.int32).contiguous().numpy()
    allowed = np.unpackbits(words.view(np.uint8), axis=1, count=vocab, bitorder="little")  # 0/1, zero-padded
    keep = allowed.view(np.int8).astype(np.int32)
    np.negative(keep, out=keep)                 # -1 where allowed, 0 where not
    np.bitwise_and(bits, keep, out=bits)
    np.invert(keep, out=keep)                   # 0 where allowed, -1 where not
    np.bitwise_and(keep, _NEG_INF_BITS, out=keep)
    np.bitwise_or(bits, keep, out=bits)


def _apply_token_bitmask_unpacked(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The same with torch ops (any device and dtype): the whole vocabulary unpacked per row."""
    vocab = logits.shape[-1]
    bits = (bitmask.unsqueeze(-1) >> _BIT_POSITIONS.to(bitmask.device)) & 1
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))


def draws_at_random(seq: Sequence) -> bool:
    """The row's token is a draw (temperature > 0 and more than one candidate), not the argmax."""
    return seq.sampling.temperature > 0 and seq.sampling.top_k != 1


def draws_by_temperature_alone(seq: Sequence) -> bool:
    """A random row whose distribution is its temperature's softmax, no top-k, top-p or min-p filter: the
    CUDA graphs can draw it (engine/cuda/graphs.py) with the arithmetic `Sampler.draw` uses for it."""
    sampling = seq.sampling
    return sampling.top_k <= 0 and sampling.top_p >= 1.0 and sampling.min_p <= 0


def row_uniform(seq: Sequence) -> float:
    """The row's one uniform for this position, drawn once: a step retried after a batch mate's failure
    (engine/step_isolation.py) reuses it, so the retry samples the same token."""
    position = len(seq.token_ids)
    if seq.drawn_at != position:
        seq.drawn_at, seq.drawn_value = position, next_uniform(seq.generator)
    return seq.drawn_value


class _RowErrors:
    """Where `_apply_grammar` reports a failing matcher, for the one row `verify_token` masks."""

    __slots__ = ("errors",)

    def __init__(self) -> None:
        self.errors: dict[int, Exception] = {}


def draw_with_draft(probs: torch.Tensor, draft: int | None, uniform: float) -> int:
    """One token from `probs` (unnormalised, [vocab]) by the uniform `uniform`, the draft first: `draft` with
    probability p(draft), else a token of the rest in proportion to p (see `Sampler.verify_token`)."""
    target = uniform * float(probs.sum())
    if draft is not None:
        p_draft = float(probs[draft])
        if target < p_draft:
            return draft
        target -= p_draft
        probs = probs.clone()
        probs[draft] = 0.0
    cdf = probs.cumsum(dim=-1)
    picked = int(torch.searchsorted(cdf, torch.tensor([target]), right=True))
    picked = min(picked, probs.shape[-1] - 1)
    while picked > 0 and float(probs[picked]) == 0.0:  # float rounding at the top end: the last token with mass
        picked -= 1
    return picked


class Sampler:
    def __init__(self, vocab_size: int, tokenizer_vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.tokenizer_vocab_size = min(tokenizer_vocab_size, vocab_size)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], result: StepResult) -> None:
        """logits: [rows, vocab] float, row i for seqs[i]. Fills result.sampled / logprobs / errors."""
        logits = logits.float().contiguous()  # penalties and biases index its flattened view
        # Only the rows that ask: one row's `logprobs` made the whole batch's log-softmax (~10 ms for 64 rows).
        asking = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
        raw_logprobs: dict[int, torch.Tensor] = {}
        if asking:
            rows = logits[asking] if len(asking) < len(seqs) else logits
            raw_logprobs = dict(zip(asking, torch.log_softmax(rows, dim=-1), strict=True))
        self._apply_grammar(logits, seqs, result)
        self._apply_min_tokens(logits, seqs)
        apply_penalties(logits, seqs)
        self._apply_logit_bias(logits, seqs)
        tokens = self.draw(logits, seqs)
        for i, seq in enumerate(seqs):
            token = seq.forced_token_ids[0] if seq.forced_token_ids else tokens[i]
            result.sampled[seq.seq_id] = token
            if i in raw_logprobs and seq.sampling.logprobs is not None:
                result.logprobs[seq.seq_id] = self._entry(raw_logprobs[i], token, seq.sampling.logprobs)

    # ---- grammar --------------------------------------------------------------------------
    def _apply_grammar(self, logits: torch.Tensor, seqs: list[Sequence], result: StepResult) -> None:
        matchers = [(i, s.matcher) for i, s in enumerate(seqs) if s.matcher is not None and not s.forced_token_ids]
        rows = [i for i, _ in matchers]
        if not rows:
            return
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(seqs), words), -1, dtype=torch.int32)
        for i, matcher in matchers:
            try:
                matcher.fill_bitmask(bitmask, i)
            except Exception as exc:  # one request's grammar failing must not stop the batch
                result.errors[seqs[i].seq_id] = exc
        if len(rows) == len(seqs):  # every row constrained (the usual batch): in place, no gather and scatter
            apply_token_bitmask(logits, bitmask)
            logits[:, self.tokenizer_vocab_size :] = float("-inf")
            return
        index = torch.tensor(rows, dtype=torch.long)
        sub = logits[index]
        apply_token_bitmask(sub, bitmask[index])
        # Ids past the tokenizer's vocabulary are padding rows of the embedding: never emit them.
        sub[:, self.tokenizer_vocab_size :] = float("-inf")
        logits[index] = sub

    def _apply_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Before `min_tokens`, the tokens that would end a choice (EOS, stop_token_ids) cannot be drawn,
        unless nothing else is left (a grammar that only allows its end): then the grammar wins."""
        vocab = logits.shape[-1]
        for i, seq in enumerate(seqs):
            if not seq.min_tokens_ban_ids or seq.num_output_tokens >= seq.sampling.min_tokens:
                continue
            banned = torch.tensor([t for t in seq.min_tokens_ban_ids if t < vocab], dtype=torch.long)
            row = logits[i].index_fill(0, banned, float("-inf"))
            if bool(torch.isfinite(row).any()):
                logits[i] = row

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """After the penalties, so a repetition penalty never scales the caller's bias; a masked (-inf) token
        stays masked whatever its bias. Each sequence makes its bias's tensors once (300 entries on 64 rows,
        made from the dicts at every step, cost ~10 ms a step on a 2-core box)."""
        vocab, at, values = logits.shape[-1], [], []
        for i, seq in enumerate(seqs):
            if seq.sampling.logit_bias:
                if seq.bias_tensors is None:
                    bias = seq.sampling.logit_bias
                    seq.bias_tensors = (torch.tensor(list(bias), dtype=torch.long), torch.tensor(list(bias.values())))
                columns, biases = seq.bias_tensors
                at.append(columns + i * vocab)
                values.append(biases)
        if at:
            logits.view(-1).index_put_((torch.cat(at),), torch.cat(values), accumulate=True)

    def draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Each row's token from its (masked, penalised) logits: the argmax, or for a random row a draw from
        its temperature/top-k/top-p/min-p distribution. Runs where `logits` are: the CUDA runner draws on
        the GPU (copying a batch's logits to the host cost more than the step), with the same uniforms.
        On the GPU everything is queued behind the forward and the host waits once, for the tokens: the
        uniforms are drawn on the host while the forward may still run."""
        random_rows = [i for i, s in enumerate(seqs) if draws_at_random(s)]
        if not random_rows:
            return logits.argmax(dim=-1).tolist()
        device = logits.device
        # Inverse-CDF draw with one uniform per row from that row's own generator: cheap,
        # and a row's token never depends on the other rows of the batch.
        uniforms = to_device([row_uniform(seqs[i]) for i in random_rows], torch.float32, device)
        index = to_device(random_rows, torch.long, device)
        tokens = logits.argmax(dim=-1)
        probs = self._random_probs(logits[index], [seqs[i] for i in random_rows])
        cdf = probs.cumsum(dim=-1)
        targets = (uniforms * cdf[:, -1]).unsqueeze(1)
        picked = torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
        tokens.index_copy_(0, index, picked.to(tokens.dtype))
        return tokens.tolist()

    @staticmethod
    def _random_probs(sub: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The distribution a random row draws from: temperature, then top-k, top-p and min-p."""
        device = sub.device  # every tensor made here goes where the logits are (the GPU's, on CUDA)
        temps = to_device([s.sampling.temperature for s in seqs], torch.float32, device).unsqueeze(1)
        sub = sub / temps
        sub = mask_top_k(sub, [s.sampling.top_k for s in seqs])
        sub = mask_top_p(sub, [s.sampling.top_p for s in seqs])
        probs = sub.softmax(dim=-1)
        if any(s.sampling.min_p > 0 for s in seqs):
            min_ps = to_device([s.sampling.min_p for s in seqs], torch.float32, device).unsqueeze(1)
            probs = probs.masked_fill(probs < min_ps * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs

    # ---- speculative verification ---------------------------------------------------------
    def verify_token(self, logits: torch.Tensor, seq: Sequence, draft: int | None) -> tuple[int, TokenLogprob | None]:
        """The token `seq` takes at its next position, given that position's logits ([1, vocab]) and the
        proposer's draft for it (None past the drafts). Everything `sample` applies is applied, from the
        sequence's state now (its grammar, penalties and min_tokens see the drafts accepted before this one).
        Greedy rows take the argmax, so the draft is accepted exactly when decoding would have produced it.
        Random rows accept the draft d with probability p(d), else draw from p without d, renormalised:
        speculative sampling's rule for a deterministic proposer, and the token's distribution stays p. One
        uniform u serves both: d when u·Σp < p(d), else the inverse CDF of p without d at u·Σp - p(d)."""
        logits = logits.float().clone().contiguous()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if seq.sampling.logprobs is not None else None
        failed = _RowErrors()
        self._apply_grammar(logits, [seq], failed)  # type: ignore[arg-type]
        if failed.errors:
            raise failed.errors[seq.seq_id]
        self._apply_min_tokens(logits, [seq])
        apply_penalties(logits, [seq])
        self._apply_logit_bias(logits, [seq])
        if seq.forced_token_ids:
            token = seq.forced_token_ids[0]
        elif not draws_at_random(seq):
            token = int(logits[0].argmax())
        else:
            token = draw_with_draft(self._random_probs(logits, [seq])[0], draft, row_uniform(seq))
        entry = None
        if raw_logprobs is not None and seq.sampling.logprobs is not None:
            entry = self._entry(raw_logprobs[0], token, seq.sampling.logprobs)
        return token, entry

    # ---- logprobs -------------------------------------------------------------------------
    @staticmethod
    def _entry(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
        top: list[tuple[int, float]] = []
        if k > 0:
            values, ids = logprobs.topk(k)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        return TokenLogprob(token_id=token, logprob=float(logprobs[token]), top=top)

    def logprob_entries(self, logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
        """Each row's logprob of its target and its k best ([positions, vocab] logits: a prompt chunk). One gather
        and one top-k for the whole chunk: a top-k and a read-back per position cost ~100 us each, 200 ms for a
        2,048-token chunk on the engine's thread."""
        logprobs = torch.log_softmax(logits[: len(targets)].float(), dim=-1)  # the last may have no target yet
        at = torch.tensor(targets, dtype=torch.long, device=logprobs.device).unsqueeze(1)
        taken = logprobs.gather(1, at).squeeze(1).tolist()
        if k <= 0:
            return [TokenLogprob(token_id=t, logprob=lp, top=[]) for t, lp in zip(targets, taken, strict=True)]
        values, ids = logprobs.topk(k, dim=-1)
        return [TokenLogprob(token_id=t, logprob=lp, top=list(zip(top_ids, top_values, strict=True)))
                for t, lp, top_ids, top_values in zip(targets, taken, ids.tolist(), values.tolist(), strict=True)]
