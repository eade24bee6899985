"""The request pipeline, declared once: which stages run, in what order, and how their results combine.

    model (ModelResolver) -> quota -> session -> reasoning -> structured_output
    -> chat template + tokenize -> admission checks -> engine

Each stage reads the request and *returns* what it adds (`StageAdditions`):
the conversation the model sees, defaults for request fields the client left
unset (a session's tools), a grammar, reasoning markers, a message-parser
layer, after-finish hooks. Only `RequestPipeline.apply` writes them into the
`PreparedRequest`, so a stage sees every earlier stage's additions and no
stage depends on another's side effects. Message parsers are composed once,
at the end, in the order `PARSER_LAYERS` declares.

Domains register their stage by name in `Extensions.stages` (see wiring.py);
a name not listed in `STAGE_ORDER` is refused at start-up.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from loraplex.engine.interfaces import CompiledGrammar
from loraplex.engine.protocol import ReasoningMarkers
from loraplex.platform.extensions import MessageParser, PlainTextParser, PreparedRequest, RequestRecord

# Why this order: quota refuses before anything is paid for; the session supplies the conversation and its
# tools/response_format, which the reasoning stage must see to know whether the request is constrained; the
# grammar is compiled last, knowing both the tools and whether it must be gated behind a think block.
STAGE_ORDER: tuple[str, ...] = ("quota", "session", "reasoning", "structured_output")

# Innermost first: the base parser (reasoning split, or plain text) is wrapped by the tool-call parser, which
# searches only the content; the session's capture wraps everything, so the transcript records exactly the
# assistant message the client received (content and tool calls).
PARSER_LAYERS: tuple[str, ...] = ("structured_output", "session")

ParserFactory = Callable[[], MessageParser]
ParserLayer = Callable[[MessageParser], MessageParser]
AfterFinish = Callable[[RequestRecord], Awaitable[None]]


@dataclass(slots=True)
class StageAdditions:
    """What one stage adds to a request. Unset fields add nothing."""

    messages: list[dict[str, Any]] | None = None     # replaces the conversation the chat template renders
    request_defaults: dict[str, Any] = field(default_factory=dict)  # body fields the client left unset
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    grammar: CompiledGrammar | None = None
    reasoning: ReasoningMarkers | None = None        # with `reasoning_budget`, the thinking segment's rules
    reasoning_budget: int | None = None
    base_parser: ParserFactory | None = None         # the innermost parser (e.g. the reasoning split)
    parser_layer: ParserLayer | None = None          # placed by the stage's name in PARSER_LAYERS
    after_finish: list[AfterFinish] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)


class Stage(Protocol):
    """One named step of preparation; may raise an ApiError or a DomainError to refuse the request."""

    async def __call__(self, prepared: PreparedRequest) -> StageAdditions | None: ...


class RequestPipeline:
    def __init__(self, stages: Mapping[str, Stage]) -> None:
        unknown = sorted(set(stages) - set(STAGE_ORDER))
        if unknown:
            raise ValueError(f"unknown pipeline stages {unknown}; the order is declared in STAGE_ORDER")
        self.stages = [(name, stages[name]) for name in STAGE_ORDER if name in stages]

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.stages]

    async def run(self, prepared: PreparedRequest) -> None:
        base: ParserFactory | None = None
        layers: dict[str, ParserLayer] = {}
        for name, stage in self.stages:
            additions = await stage(prepared)
            if additions is None:
                continue
            apply(prepared, additions)
            if additions.base_parser is not None:
                base = additions.base_parser
            if additions.parser_layer is not None:
                layers[name] = additions.parser_layer
        prepared.parser_factory = compose_parsers(base or PlainTextParser, layers)


def apply(prepared: PreparedRequest, additions: StageAdditions) -> None:
    """Write one stage's additions into the request (the only writer during preparation)."""
    if additions.messages is not None:
        prepared.messages = additions.messages
    defaults = {k: v for k, v in additions.request_defaults.items() if getattr(prepared.body, k, None) is None}
    if defaults:
        prepared.body = prepared.body.model_copy(update=defaults)
    prepared.template_kwargs.update(additions.template_kwargs)
    if additions.grammar is not None:
        prepared.grammar = additions.grammar
    if additions.reasoning is not None:
        prepared.reasoning = additions.reasoning
        prepared.sampling.max_reasoning_tokens = additions.reasoning_budget
    prepared.after_finish.extend(additions.after_finish)
    prepared.metadata.update(additions.metadata)


def compose_parsers(base: ParserFactory, layers: Mapping[str, ParserLayer]) -> ParserFactory:
    ordered = [layers[name] for name in PARSER_LAYERS if name in layers]

    def factory() -> MessageParser:
        parser = base()
        for layer in ordered:
            parser = layer(parser)
        return parser

    return factory
