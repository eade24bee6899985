"""What crosses the boundary between the API layer and the engine.

Plain dataclasses of ints, floats, strings and lists, so they can cross a
process boundary later. The two non-plain fields (`grammar`, and nothing else)
hold objects that satisfy the protocols in `engine.interfaces`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplex.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from loraplex.engine.interfaces import CompiledGrammar


class FinishReason:
    STOP = "stop"      # EOS, a stop token id, a stop string, or the grammar terminated
    LENGTH = "length"  # max_tokens reached (or the context ran out)
    ABORT = "abort"    # the caller aborted (client disconnect, server shutdown)
    ERROR = "error"    # this request failed inside the engine; the others go on


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1            # -1 or 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None    # same seed + same prompt = same output, whatever the batch mates
    n: int = 1                 # choices share the prompt's KV blocks
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0        # EOS and stop_token_ids cannot be drawn before this many output tokens
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) that ended a choice
    skip_special_tokens: bool = True  # special tokens' text is left out of the output
    logprobs: int | None = None         # None: off; k >= 0: the chosen token's logprob and k alternatives
    prompt_logprobs: int | None = None  # for /v1/completions echo + logprobs
    max_reasoning_tokens: int | None = None  # thinking budget; needs EngineRequest.reasoning
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before drawing (OpenAI's -100..100)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field. Every number is checked against what the engine
        can represent (integers within int64, floats finite) and what makes sense; `vocab_size`, where known,
        bounds top_k and token ids."""
        _int_in("max_tokens", self.max_tokens, 1, INT32_MAX)
        _float_in("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0  # greedy: logits divided by it would overflow float32 (1e-300 is 0 there)
        _float_in("top_p", self.top_p, 0.0, 1.0, low_open=True)
        top_k_max = vocab_size if vocab_size is not None else INT32_MAX
        _int_in("top_k", self.top_k, -1, top_k_max, why="-1 or 0 (off) or a positive integer up to the vocabulary")
        _float_in("min_p", self.min_p, 0.0, 1.0)
        _float_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _float_in("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True)
        if self.seed is not None:
            _int_in("seed", self.seed, INT64_MIN, INT64_MAX)
        _int_in("n", self.n, 1, INT32_MAX)
        if self.logprobs is not None:
            _int_in("top_logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int_in("logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", param="stop")
        token_max = vocab_size - 1 if vocab_size is not None else INT32_MAX
        for i, token in enumerate(self.stop_token_ids):
            if not _is_int(token) or not 0 <= token <= token_max:
                raise InvalidRequestError(f"stop_token_ids must be token ids in [0, {token_max}]; item {i} is "
                                          f"{token!r}", param="stop_token_ids")
        _int_in("min_tokens", self.min_tokens, 0, INT32_MAX)
        if self.max_reasoning_tokens is not None:
            _int_in("max_reasoning_tokens", self.max_reasoning_tokens, 0, INT32_MAX)
        for token, bias in (self.logit_bias or {}).items():
            if not _is_int(token) or not 0 <= token <= token_max:
                raise InvalidRequestError(f"logit_bias keys must be token ids >= 0 and <= {token_max}; got {token!r}",
                                          param="logit_bias")
            if not _is_number(bias) or not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100]; got {bias} for token {token}",
                                          param="logit_bias")


INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TEMPERATURE = 100.0       # past this every distribution is flat to float32
MIN_TEMPERATURE = 1e-5        # below this a draw is the argmax anyway, and is made as one (as vLLM does)
MAX_REPETITION_PENALTY = 100.0
MAX_LOGPROBS = 20             # OpenAI's top_logprobs limit


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _int_in(param: str, value: object, low: int, high: int, why: str | None = None) -> None:
    if not _is_int(value) or not low <= value <= high:  # type: ignore[operator]
        raise InvalidRequestError(f"{param} must be an integer in [{low}, {high}]" + (f" ({why})" if why else "")
                                  + f"; got {value!r}", param=param)


def _float_in(param: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    ok = _is_number(value) and (low < value if low_open else low <= value) and value <= high  # type: ignore[operator]
    if not ok:
        bracket = "(" if low_open else "["
        raise InvalidRequestError(f"{param} must be a finite number in {bracket}{low:g}, {high:g}]; got {value!r}",
                                  param=param)


@dataclass(slots=True)
class ReasoningMarkers:
    """Token ids that open and close a model's reasoning segment.

    `starts_inside` is true for models whose chat template opens the block
    itself, so generation begins inside the reasoning segment.
    """

    start_token_ids: list[int]
    end_token_ids: list[int]
    starts_inside: bool = False


@dataclass(slots=True)
class EngineRequest:
    request_id: str                      # unique among live requests; a duplicate is refused
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tenant_id: str = "default"
    adapter_id: str | None = None        # None: the base model
    cache_salt: str = ""                 # extra salt; tenant_id and adapter_id always salt the prefix cache
    grammar: CompiledGrammar | None = None
    reasoning: ReasoningMarkers | None = None
    session_id: str | None = None        # keep this request's KV blocks pinned under the session afterwards
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0                    # within its tenant, lower runs first (vLLM's semantics)
    background: bool = False             # batch work: runs on capacity interactive requests leave, preempted first
    tenant_weight: float = 1.0           # the tenant's weight in the engine's fair sharing


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice produced since the previous RequestOutput."""

    index: int
    text: str = ""                       # new text (filled on the caller's side); never a broken UTF-8 sequence
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None     # a FinishReason value once this choice is done
    stop_reason: str | int | None = None # the stop string or token id that ended it
    num_reasoning_tokens: int = 0        # cumulative, inside the reasoning segment
    num_output_tokens: int = 0           # cumulative tokens of this choice
    hide_last_token: bool = False        # the last token ended the choice (EOS, a stop token id): no text for it


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    choices: list[ChoiceDelta]           # only the choices with news
    finished: bool                       # every choice is done
    num_prompt_tokens: int
    num_cached_tokens: int               # prompt tokens whose KV came from the prefix cache or a session
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output only; None for the first token
    error: str | None = None             # set when the request failed inside the engine
    # time.monotonic() when the caller's side received the first step merged into this output, where outputs
    # are held back until the request ends (OutputStream's whole mode); None: received as it is read
    received_at: float | None = None
