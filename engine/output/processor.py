"""Per-request token state in the engine: stop conditions the engine alone knows, reasoning budget, deltas.

The engine hands every sampled token to `RequestState.add_token`; the
state decides whether the choice finished (EOS, a stop token id, the
grammar, the length) and collects the token ids and logprobs of the next
delta. Text is made on the caller's side (`engine.output.text`): the engine
loop never detokenizes or matches stop strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.engine.interfaces import BudgetedGrammarMatcher
from loraplex.engine.protocol import ChoiceDelta, EngineRequest, FinishReason, RequestOutput, TokenLogprob
from loraplex.engine.sequence import Sequence


@dataclass(slots=True)
class ChoiceState:
    seq: Sequence
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    hide_last_token: bool = False  # the token that ended the choice has no text (EOS, a stop token id)
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    has_news: bool = False


class RequestState:
    def __init__(
        self, request: EngineRequest, seqs: list[Sequence], eos_token_ids: set[int], max_model_len: int,
    ) -> None:
        self.request = request
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.stop_token_ids = set(request.sampling.stop_token_ids)
        sampling = request.sampling
        self.choices = [ChoiceState(seq) for seq in seqs]
        if sampling.min_tokens:
            ending = set(self.stop_token_ids) if sampling.ignore_eos else self.stop_token_ids | eos_token_ids
            for seq in seqs:
                seq.min_tokens_ban_ids = sorted(ending)
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if request.sampling.prompt_logprobs is not None else None
        )
        self.prompt_logprobs_sent = False
        self.error: str | None = None
        for choice in self.choices:
            self._check_reasoning_budget(choice.seq)

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.choices]

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def add_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> bool:
        """Record one sampled token of `seq`; True if that choice is now finished."""
        choice = self.choices[seq.index]
        sampling = self.request.sampling
        seq.token_ids.append(token)
        if seq.forced_token_ids:
            seq.forced_token_ids.pop(0)
        choice.has_news = True
        choice.pending_token_ids.append(token)
        if logprob is not None:
            choice.pending_logprobs.append(logprob)
        self._track_reasoning(seq)
        if seq.matcher is not None and not seq.matcher.accept_token(token):
            self._finish(choice, FinishReason.ERROR, None)
            choice.hide_last_token = True
            self.error = f"choice {seq.index}: token {token} rejected by the grammar"
            return True
        if token in self.eos_token_ids and not sampling.ignore_eos:
            self._finish(choice, _grammar_finish(seq), None)
            choice.hide_last_token = True
        elif token in self.stop_token_ids:
            self._finish(choice, FinishReason.STOP, token)
            choice.hide_last_token = not sampling.include_stop_str_in_output
        elif seq.matcher is not None and seq.matcher.is_terminated():
            self._finish(choice, _grammar_finish(seq), None)
        elif seq.num_output_tokens >= sampling.max_tokens or len(seq.token_ids) >= self.max_model_len:
            self._finish(choice, FinishReason.LENGTH, None)
        if choice.finish_reason is not None:
            return True
        self._check_reasoning_budget(seq)
        return False

    def _finish(self, choice: ChoiceState, reason: str, stop_reason: str | int | None) -> None:
        if choice.finish_reason is None:
            choice.finish_reason = reason
            choice.stop_reason = stop_reason
            choice.has_news = True

    def finish_all(self, reason: str, error: str | None = None) -> None:
        for choice in self.choices:
            self._finish(choice, reason, None)
        if error is not None:
            self.error = error

    # ---- reasoning budget -----------------------------------------------------------------
    def _track_reasoning(self, seq: Sequence) -> None:
        markers = self.request.reasoning
        if markers is None:
            return
        if seq.reasoning_inside:
            seq.num_reasoning_tokens += 1
            if _output_ends_with(seq, markers.end_token_ids):
                seq.reasoning_inside = False
        elif _output_ends_with(seq, markers.start_token_ids):
            seq.reasoning_inside = True
            seq.num_reasoning_tokens += len(markers.start_token_ids)

    def _check_reasoning_budget(self, seq: Sequence) -> None:
        """Once the budget is spent inside the segment, force the end marker."""
        markers = self.request.reasoning
        budget = self.request.sampling.max_reasoning_tokens
        if markers is None or budget is None or not seq.reasoning_inside or seq.forced_token_ids:
            return
        if seq.num_reasoning_tokens >= budget:
            seq.forced_token_ids = list(markers.end_token_ids)

    # ---- deltas ---------------------------------------------------------------------------
    def take_output(self, num_cached_tokens: int) -> RequestOutput | None:
        """The news since the last call, or None if nothing is new."""
        deltas: list[ChoiceDelta] = []
        for i, choice in enumerate(self.choices):
            if not choice.has_news:
                continue
            deltas.append(ChoiceDelta(
                index=i,
                token_ids=choice.pending_token_ids,
                logprobs=choice.pending_logprobs if self.request.sampling.logprobs is not None else None,
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
                num_reasoning_tokens=choice.seq.num_reasoning_tokens,
                num_output_tokens=choice.seq.num_output_tokens,
                hide_last_token=choice.hide_last_token and choice.finish_reason is not None,
            ))
            choice.pending_token_ids, choice.pending_logprobs = [], []
            choice.has_news = False
        if not deltas:
            return None
        prompt_logprobs = None
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            prompt_logprobs = self.prompt_logprobs
            self.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=self.request.request_id,
            choices=deltas,
            finished=self.finished,
            num_prompt_tokens=len(self.request.prompt_token_ids),
            num_cached_tokens=num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            error=self.error,
        )


def _grammar_finish(seq: Sequence) -> str:
    """`length` when the token budget made the grammar close the output early, else `stop`."""
    matcher = seq.matcher
    if isinstance(matcher, BudgetedGrammarMatcher) and matcher.closed_by_budget():
        return FinishReason.LENGTH
    return FinishReason.STOP


def _output_ends_with(seq: Sequence, marker: list[int]) -> bool:
    """Whether the output ends with `marker` (never for an empty one), looking at its last tokens only: this
    runs for every token, and slicing out the whole output made it cost as much as the output is long."""
    n = len(marker)
    return n > 0 and seq.num_output_tokens >= n and seq.token_ids[-n:] == marker
