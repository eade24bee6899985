"""What crosses the boundary between the API layer and the engine.

Plain dataclasses of ints, floats, strings and lists, so they can cross a
process boundary later. The two non-plain fields (`grammar`, and nothing else)
hold objects that satisfy the protocols in `engine.interfaces`.
"""

from __future__ import annotations

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

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be an integer >= 1", param="max_tokens")
        if self.temperature < 0:
            raise InvalidRequestError("temperature must be >= 0", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
        if self.top_k < -1:
            raise InvalidRequestError("top_k must be -1 (off), 0 (off) or a positive integer", param="top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p must be in [0, 1]", param="min_p")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidRequestError("presence_penalty must be in [-2, 2]", param="presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidRequestError("frequency_penalty must be in [-2, 2]", param="frequency_penalty")
        if self.repetition_penalty <= 0:
            raise InvalidRequestError("repetition_penalty must be > 0", param="repetition_penalty")
        if not isinstance(self.n, int) or self.n < 1:
            raise InvalidRequestError("n must be an integer >= 1", param="n")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError("top_logprobs must be in [0, 20]", param="top_logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise InvalidRequestError("logprobs must be in [0, 20]", param="logprobs")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", param="stop")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be token ids >= 0", param="stop_token_ids")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequestError("min_tokens must be an integer >= 0", param="min_tokens")
        if self.max_reasoning_tokens is not None and self.max_reasoning_tokens < 0:
            raise InvalidRequestError("max_reasoning_tokens must be >= 0", param="max_reasoning_tokens")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids >= 0; got {token!r}", param="logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100]; got {bias} for token {token}",
                                          param="logit_bias")


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
