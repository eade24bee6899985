"""What one tenant may put in a session, checked when the session is created, before anything is stored.

A session keeps its system prompt, tools and response_format for every turn,
so each is bounded here (400 naming the field) rather than found too large or
malformed on every later turn; how many sessions a tenant keeps alive is
bounded by the store, atomically (`SessionStore.create(max_per_tenant=...)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.engine.errors import InvalidRequestError
from loraplex.grammar.schema.walk import SchemaShapeLimits
from loraplex.grammar.validation import check_spec_sizes, parse_tools, response_format_spec


@dataclass(frozen=True, slots=True)
class SessionLimits:
    max_system_chars: int = 32 * 1024
    max_tools: int = 128
    max_spec_bytes: int = 256 * 1024      # tools, tool_choice and response_format, each, as JSON
    max_schema_depth: int = 64
    max_schema_nodes: int = 20000

    @classmethod
    def from_settings(cls, settings: Any) -> SessionLimits:
        return cls(max_system_chars=settings.max_session_system_chars, max_tools=settings.grammar_max_tools,
                   max_spec_bytes=settings.grammar_max_spec_bytes, max_schema_depth=settings.grammar_max_schema_depth,
                   max_schema_nodes=settings.grammar_max_schema_nodes)


def check_session_create(system: str | None, tools: list[dict[str, Any]] | None, tool_choice: Any,
                         response_format: dict[str, Any] | None, limits: SessionLimits) -> None:
    """Raise InvalidRequestError naming the first field past its limit or malformed. Bounded work: counts and
    sizes are checked before any schema is walked."""
    if system is not None and len(system) > limits.max_system_chars:
        raise InvalidRequestError(
            f"system holds {len(system)} characters; a session's system prompt may hold at most "
            f"{limits.max_system_chars}", param="system")
    if tools is not None and len(tools) > limits.max_tools:
        raise InvalidRequestError(f"tools holds {len(tools)} tools; the limit is {limits.max_tools}", param="tools")
    check_spec_sizes({"tools": tools, "tool_choice": tool_choice, "response_format": response_format},
                     limits.max_spec_bytes)
    shape = SchemaShapeLimits(limits.max_schema_depth, limits.max_schema_nodes)
    parse_tools(tools, tool_choice, None, max_tools=limits.max_tools, limits=shape)
    response_format_spec(response_format, limits=shape)
