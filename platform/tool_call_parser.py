"""Turns the model's text into OpenAI content and `tool_calls`, incrementally.

Fed the text deltas as they stream, the parser emits content deltas and
tool-call deltas shaped as OpenAI streams them: the first delta of a call has
its index, id, type and name with empty arguments; later ones add argument
text. Text that might be the start of `<tool_call>` is held back until it is
known not to be. Non-streaming answers feed the whole text at once, so both
paths share one parser.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from loraplex.grammar.tools import TOOL_CALL_BEGIN, TOOL_CALL_END

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    id: str | None = None        # set on a call's first delta only
    name: str | None = None      # set on a call's first delta only
    arguments: str = ""

    def as_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
            function = {"name": self.name, "arguments": self.arguments}
        out["function"] = function
        return out


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    complete: bool = False

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallStreamParser:
    _TEXT, _HEADER, _ARGS, _TRAILER = range(4)

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.content = ""             # all content emitted so far
        self._state = self._TEXT
        self._buffer = ""             # text not yet emitted or consumed
        self._held = ""               # whitespace-only content waiting for real text
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        progressed = True
        while progressed and self._buffer:
            progressed = self._step(out)
        self.content += out.content
        return out

    def finish(self) -> ParsedDelta:
        """Flush what was held back once the stream has ended."""
        out = ParsedDelta()
        # After a call, a held-back partial `<tool_call>` is the start of a next call cut off by max_tokens:
        # markup, not content. With no call yet it may be real text ("a <"), so it is released.
        if self._state == self._TEXT and not self.calls:
            self._add_content(out, self._buffer)
            out.content += self._held
        elif self._state == self._TEXT:
            self._add_content(out, self._buffer[: len(self._buffer) - _partial_suffix(self._buffer, TOOL_CALL_BEGIN)])
        self._buffer = self._held = ""
        self.content += out.content
        return out

    @property
    def final_content(self) -> str | None:
        """Message content as OpenAI returns it next to tool calls: None when there is none."""
        if self.calls:
            return self.content.strip() or None
        return self.content

    def _step(self, out: ParsedDelta) -> bool:
        if self._state == self._TEXT:
            return self._step_text(out)
        if self._state == self._HEADER:
            return self._step_header(out)
        if self._state == self._ARGS:
            return self._step_args(out)
        return self._step_trailer()

    def _step_text(self, out: ParsedDelta) -> bool:
        start = self._buffer.find(TOOL_CALL_BEGIN)
        if start >= 0:
            self._add_content(out, self._buffer[:start])
            self._held = ""  # whitespace before a call is layout, not content
            self._buffer = self._buffer[start + len(TOOL_CALL_BEGIN):]
            self._state = self._HEADER
            return True
        keep = _partial_suffix(self._buffer, TOOL_CALL_BEGIN)
        self._add_content(out, self._buffer[: len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _add_content(self, out: ParsedDelta, text: str) -> None:
        # Whitespace-only text waits until real text follows, so the newlines
        # around and between calls never surface as content.
        self._held += text
        if self._held.strip():
            out.content += self._held
            self._held = ""

    def _step_header(self, out: ParsedDelta) -> bool:
        match = _HEADER.match(self._buffer)
        if match is None:
            return False
        call = ToolCall(id=new_call_id(), name=json.loads(match.group(1)), arguments="")
        self.calls.append(call)
        out.tool_calls.append(ToolCallDelta(len(self.calls) - 1, call.id, call.name, ""))
        self._buffer = self._buffer[match.end():]
        self._state = self._ARGS
        self._depth, self._in_string, self._escaped = 0, False, False
        return True

    def _step_args(self, out: ParsedDelta) -> bool:
        end = None
        for i, ch in enumerate(self._buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        piece = self._buffer if end is None else self._buffer[:end]
        if self.calls[-1].arguments == "":
            piece = piece.lstrip()
        if piece:
            self.calls[-1].arguments += piece
            self._add_arguments(out, piece)
        self._buffer = "" if end is None else self._buffer[end:]
        if end is not None:
            self.calls[-1].complete = True
            self._state = self._TRAILER
        return end is not None

    def _add_arguments(self, out: ParsedDelta, piece: str) -> None:
        index = len(self.calls) - 1
        last = out.tool_calls[-1] if out.tool_calls else None
        if last is not None and last.index == index and last.id is None:
            last.arguments += piece
        else:
            out.tool_calls.append(ToolCallDelta(index, arguments=piece))

    def _step_trailer(self) -> bool:
        end = self._buffer.find(TOOL_CALL_END)
        if end < 0:
            return False
        self._buffer = self._buffer[end + len(TOOL_CALL_END):]
        self._state = self._TEXT
        return True


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
