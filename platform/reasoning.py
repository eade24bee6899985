"""Thinking tokens on the API: reasoning markers, the reasoning/content split and the thinking budget.

`ReasoningStage` is the pipeline's `reasoning` stage. For chat requests on a model family with a
configured reasoning format it gives the engine the marker token ids (so it
counts reasoning tokens and can close the block when the budget is spent) and
sets a message parser that moves the think block into `reasoning_content`.

The budget comes from the request: the extension `max_reasoning_tokens`
(already on `prepared.sampling`, validated by SamplingParams) wins over
`reasoning_effort` (none/minimal/low/medium/high, mapped to the budgets in Settings; none is 0), which
wins over the server default `Settings.max_reasoning_tokens`.

Structured output (response_format / tools) gates its grammar behind the think
block when markers are set; that happens only when the request asks for
reasoning (either field above) or the chat template has opened the block, so
models that never think keep answering straight into the grammar.
"""

from __future__ import annotations

from typing import Any

from loraplex.engine.core.client import EngineClient
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.protocol import ReasoningMarkers
from loraplex.platform.extensions import Extensions, MessageParser, PreparedRequest
from loraplex.platform.pipeline import StageAdditions
from loraplex.platform.reasoning_parser import (
    REASONING_FORMATS,
    ReasoningFormat,
    reasoning_format_for,
    reasoning_markers,
)
from loraplex.platform.settings import Settings
from loraplex.platform.structured import ReasoningMessageParser

EFFORTS = ("none", "minimal", "low", "medium", "high")  # none: a budget of 0, the think block closes at once


def resolve_format(name: str, model_type: str | None) -> ReasoningFormat | None:
    """Settings.reasoning_format: "none" (off), "think" (`<think>`...`</think>`), "auto" (by model family),
    or a family name from platform.reasoning_parser.REASONING_FORMATS."""
    key = name.strip().lower()
    if key == "none":
        return None
    if key == "think":
        return ReasoningFormat()
    if key == "auto":
        return reasoning_format_for(model_type)
    if key in REASONING_FORMATS:
        return REASONING_FORMATS[key]
    raise ValueError(f"unknown reasoning_format {name!r}; expected none, think, auto or one of {sorted(REASONING_FORMATS)}")


class ReasoningStage:
    """pipeline.Stage; markers are computed once per served model, not per request."""

    def __init__(self, fmt: ReasoningFormat, markers: ReasoningMarkers, budgets: dict[str, int],
                 default_budget: int | None = None) -> None:
        self.fmt = fmt
        self.markers = markers
        self.budgets = budgets
        self.default_budget = default_budget

    async def __call__(self, prepared: PreparedRequest) -> StageAdditions | None:
        if prepared.kind != "chat":
            return None  # completions return raw text; there is no message to split
        budget = self._budget(prepared)
        # `prepared.body` already holds what the session stage supplied (its tools, response_format).
        if _constrained(prepared.body) and not self.markers.starts_inside and not _asks_for_reasoning(prepared):
            # With markers set, the grammar is gated and the think marker becomes allowed first; a model that
            # does not think would wander into a think block instead of answering. Think only when asked to
            # (or when the template has already opened the block).
            return None
        fmt, inside = self.fmt, self.markers.starts_inside

        def parser() -> MessageParser:
            return ReasoningMessageParser(fmt, starts_inside=inside)

        return StageAdditions(reasoning=self.markers, reasoning_budget=budget, base_parser=parser)

    def _budget(self, prepared: PreparedRequest) -> int | None:
        effort = getattr(prepared.body, "reasoning_effort", None)
        if effort is not None and (not isinstance(effort, str) or effort.lower() not in self.budgets):
            raise InvalidRequestError(
                f"reasoning_effort must be one of {', '.join(EFFORTS)}; got {effort!r}", param="reasoning_effort"
            )
        if prepared.sampling.max_reasoning_tokens is not None:
            return prepared.sampling.max_reasoning_tokens  # the explicit extension wins
        return self.default_budget if effort is None else self.budgets[effort.lower()]


def _constrained(body: Any) -> bool:
    response_format = getattr(body, "response_format", None) or {}
    tools = getattr(body, "tools", None)
    return response_format.get("type", "text") != "text" or bool(tools and getattr(body, "tool_choice", None) != "none")


def _asks_for_reasoning(prepared: PreparedRequest) -> bool:
    return getattr(prepared.body, "reasoning_effort", None) not in (None, "none") or prepared.sampling.max_reasoning_tokens is not None


def build_reasoning(settings: Settings, tokenizer: Any, model_type: str | None) -> ReasoningStage | None:
    fmt = resolve_format(settings.reasoning_format, model_type)
    if fmt is None:
        return None
    budgets = {"none": 0, "minimal": settings.reasoning_budget_minimal, "low": settings.reasoning_budget_low,
               "medium": settings.reasoning_budget_medium, "high": settings.reasoning_budget_high}
    return ReasoningStage(fmt, reasoning_markers(tokenizer, fmt), budgets, settings.max_reasoning_tokens)


def install_reasoning(extensions: Extensions, settings: Settings, *, engine: EngineClient) -> None:
    stage = build_reasoning(settings, engine.tokenizer, engine.model_config.model_type)
    if stage is not None:
        extensions.stages["reasoning"] = stage
