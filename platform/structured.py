"""Structured output on the API: `response_format`, `tools`, `tool_choice`, `parallel_tool_calls`.

`StructuredOutputPreparer` is the pipeline's `structured_output` stage
(pipeline.Stage): it validates the fields (400 naming the field),
puts the tools in front of the model (chat template or a system prompt),
compiles the grammar off the engine thread (cached by content) and sets a
message parser that turns the model's tool-call text into OpenAI `tool_calls`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from loraplex.engine.core.client import EngineClient
from loraplex.grammar.compiler import GrammarCompilerService, GrammarLimits
from loraplex.grammar.runtime.reasoning_gate import ReasoningGatedGrammar
from loraplex.grammar.schema.walk import SchemaShapeLimits
from loraplex.grammar.spec import GrammarSpec
from loraplex.grammar.tools import (
    content_format_for,
    messages_with_tools,
    template_supports_tools,
    tool_call_spec,
)
from loraplex.grammar.validation import ToolRequest, check_spec_sizes, parse_tools, response_format_spec
from loraplex.platform.api.compile_slots import TenantCompileSlots
from loraplex.platform.extensions import Extensions, MessageDelta, MessageParser, PreparedRequest
from loraplex.platform.pipeline import StageAdditions
from loraplex.platform.reasoning_parser import ReasoningFormat, ReasoningParser
from loraplex.platform.settings import Settings
from loraplex.platform.tool_call_parser import ToolCallStreamParser

# A non-strict schema that no backend enforces whole is served with what was relaxed named here.
GRAMMAR_RELAXED_HEADER = "x-loraplex-grammar-relaxed"


def relaxation_headers(metadata: Mapping[str, Any]) -> dict[str, str]:
    """The response headers that document a relaxed grammar (none for an exact one)."""
    relaxed = metadata.get("grammar_relaxed")
    if not relaxed:
        return {}
    # Property names are the tenant's: CR/LF (and any control or non-ASCII character) is escaped, never sent
    return {GRAMMAR_RELAXED_HEADER: str(relaxed).encode("unicode_escape").decode("ascii")[:1000]}


class ToolCallMessageParser:
    """Wraps the request's other parser (e.g. reasoning): its content is searched for tool calls."""

    def __init__(self, inner: MessageParser) -> None:
        self._inner = inner
        self._calls = ToolCallStreamParser()

    def feed(self, text: str) -> MessageDelta:
        return self._split(self._inner.feed(text), final=False)

    def finish(self, finish_reason: str) -> tuple[MessageDelta, str]:
        rest, finish_reason = self._inner.finish(finish_reason)
        delta = self._split(rest, final=True)
        if self._calls.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return delta, finish_reason

    def _split(self, delta: MessageDelta, *, final: bool) -> MessageDelta:
        parsed = self._calls.feed(delta.content)
        content, calls = parsed.content, parsed.tool_calls
        if final:
            tail = self._calls.finish()
            content += tail.content
            calls += tail.tool_calls
        return MessageDelta(
            content=content,
            reasoning_content=delta.reasoning_content,
            tool_calls=[*delta.tool_calls, *(c.as_openai() for c in calls)],
        )


class ReasoningMessageParser:
    """extensions.MessageParser splitting reasoning from content at the model's think markers.

    The reasoning stage makes it the request's base parser; the tool-call parser wraps it
    (pipeline.PARSER_LAYERS) and searches only the content (never the reasoning) for calls.
    """

    def __init__(self, fmt: ReasoningFormat, *, starts_inside: bool = False) -> None:
        self._parser = ReasoningParser(fmt, starts_inside=starts_inside)

    def feed(self, text: str) -> MessageDelta:
        delta = self._parser.feed(text)
        return MessageDelta(content=delta.content, reasoning_content=delta.reasoning)

    def finish(self, finish_reason: str) -> tuple[MessageDelta, str]:
        delta = self._parser.finish()
        return MessageDelta(content=delta.content, reasoning_content=delta.reasoning), finish_reason


class StructuredOutputPreparer:
    """pipeline.Stage for response_format and tools (chat and completions)."""

    def __init__(self, compiler: GrammarCompilerService, chat_template: str | None,
                 slots: TenantCompileSlots | None = None) -> None:
        self.compiler = compiler
        self.slots = slots or TenantCompileSlots(0, 0.0)
        self.template_has_tools = template_supports_tools(chat_template)

    async def __call__(self, prepared: PreparedRequest) -> StageAdditions | None:
        body = prepared.body
        additions = StageAdditions()
        limits = self.compiler.limits
        shape = SchemaShapeLimits(limits.max_schema_depth, limits.max_schema_nodes)
        response_format = getattr(body, "response_format", None)
        chat = prepared.kind == "chat"
        if response_format is None and not (chat and body.tools):
            spec, tools = self._parse(body, None, chat, shape)  # no schema: only tool_choice to check
        else:
            # In a thread: checking schemas near the size limits against their metaschema takes seconds of CPU,
            # which must not stall the event loop every tenant's requests and streams share.
            spec, tools = await asyncio.to_thread(self._parse, body, response_format, chat, shape)
        if tools is not None:
            spec = self._prepare_tools(prepared, tools, spec, additions)
        if spec is not None:
            async with self.slots.hold(prepared.tenant_id, spec):
                grammar = await self.compiler.compile(spec)
            # A reasoning model thinks freely first; the grammar constrains its answer.
            # (prepared.reasoning comes from the reasoning stage, which runs before this one.)
            additions.grammar = grammar if prepared.reasoning is None else ReasoningGatedGrammar(grammar, prepared.reasoning)
            additions.metadata["grammar"] = spec.kind
            if grammar.relaxed:  # a non-strict schema no backend enforces whole: say what was dropped
                if spec.strict:  # never reached: the compiler refuses a strict schema it cannot enforce
                    raise RuntimeError("a strict schema came back relaxed")
                additions.metadata["grammar_relaxed"] = grammar.relaxed  # sent as GRAMMAR_RELAXED_HEADER
        return additions

    def _parse(self, body: Any, response_format: Any, chat: bool, shape: SchemaShapeLimits
               ) -> tuple[GrammarSpec | None, ToolRequest | None]:
        fields = {"response_format": response_format}
        if chat:
            fields |= {"tools": body.tools, "tool_choice": body.tool_choice}
        check_spec_sizes(fields, self.compiler.limits.max_spec_bytes)
        spec = response_format_spec(response_format, limits=shape)
        tools = None
        if chat:
            tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                                max_tools=self.compiler.limits.max_tools, limits=shape)
        return spec, tools

    def _prepare_tools(self, prepared: PreparedRequest, tools: ToolRequest, spec: GrammarSpec | None,
                       additions: StageAdditions) -> GrammarSpec | None:
        additions.messages = messages_with_tools(
            prepared.messages or [], tools, template_has_tools=self.template_has_tools
        )
        if tools.mode == "none":
            return spec  # the tools are not offered; any response_format still applies
        if self.template_has_tools:
            additions.template_kwargs["tools"] = [t.as_openai() for t in tools.offered]
        additions.parser_layer = ToolCallMessageParser
        return tool_call_spec(tools, content_format_for(spec))


def install_structured_output(extensions: Extensions, settings: Settings, *, engine: EngineClient) -> None:
    """Register the stage (last in pipeline.STAGE_ORDER, so quota refusals never pay for a compilation)."""
    limits = GrammarLimits(
        compile_timeout_s=settings.grammar_compile_timeout_s, max_spec_bytes=settings.grammar_max_spec_bytes,
        max_compiled_bytes=settings.grammar_max_compiled_bytes,
        backend=settings.grammar_backend, max_schema_depth=settings.grammar_max_schema_depth,
        max_schema_nodes=settings.grammar_max_schema_nodes, max_tools=settings.grammar_max_tools,
        cache_dir=settings.grammar_cache_dir, max_completion_tokens=settings.grammar_max_completion_tokens,
    )
    preparer = build_structured_output(engine.tokenizer, engine.model_config.vocab_size, limits)
    preparer.slots = TenantCompileSlots(settings.grammar_compiles_per_tenant, settings.grammar_compile_wait_s)
    extensions.stages["structured_output"] = preparer

    async def close() -> None:
        preparer.compiler.close()

    extensions.on_shutdown.append(close)


def build_structured_output(tokenizer: Any, vocab_size: int, limits: GrammarLimits | None = None) -> StructuredOutputPreparer:
    """The preparer for one served model; `vocab_size` is the model's logits width (bitmask width)."""
    compiler = GrammarCompilerService(tokenizer, vocab_size, limits)
    return StructuredOutputPreparer(compiler, getattr(tokenizer, "chat_template", None))
