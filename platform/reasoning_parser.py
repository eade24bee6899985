"""Splits a model's streamed output into reasoning and content at its think markers.

Markers are configured per model family. Some chat templates open the think
block themselves (the generation prompt ends in `<think>`), so the output starts
inside the reasoning segment; `starts_inside` covers that, and is detected from
the template. Text that might be the start of a marker is held back until it
is known, so a marker split across deltas never leaks into either side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.engine.protocol import ReasoningMarkers


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    start: str = "<think>"
    end: str = "</think>"


# Model families (HF config `model_type`) and their markers; the plain
# `<think>` pair is the default, so families appear here only when they differ.
REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "default": ReasoningFormat(),
    "gpt_oss": ReasoningFormat("<|channel|>analysis<|message|>", "<|end|>"),
    "granite": ReasoningFormat("Here is my thought process:", "Here is my response:"),
}


def reasoning_format_for(model_type: str | None) -> ReasoningFormat:
    return REASONING_FORMATS.get(model_type or "default", REASONING_FORMATS["default"])


def template_opens_reasoning(tokenizer: Any, fmt: ReasoningFormat) -> bool:
    """True when the chat template's generation prompt already ends inside the think block."""
    try:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a template that cannot render a one-message chat opens nothing
        return False
    return isinstance(prompt, str) and prompt.rstrip().endswith(fmt.start)


def reasoning_markers(tokenizer: Any, fmt: ReasoningFormat) -> ReasoningMarkers:
    """The engine's token-level markers (for thinking budgets and counting) for `fmt`."""
    return ReasoningMarkers(
        start_token_ids=list(tokenizer.encode(fmt.start, add_special_tokens=False)),
        end_token_ids=list(tokenizer.encode(fmt.end, add_special_tokens=False)),
        starts_inside=template_opens_reasoning(tokenizer, fmt),
    )


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Feed text deltas in order; each call returns the new reasoning and content text."""

    _BEFORE, _INSIDE, _AFTER = range(3)

    def __init__(self, fmt: ReasoningFormat, *, starts_inside: bool = False) -> None:
        self._fmt = fmt
        self._state = self._INSIDE if starts_inside else self._BEFORE
        self._strip_leading = False  # the blank lines right after the closing marker are layout
        self._buffer = ""
        self.reasoning = ""
        self.content = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state == self._INSIDE

    def feed(self, text: str) -> ReasoningDelta:
        self._buffer += text
        out = ReasoningDelta()
        while self._buffer and self._step(out):
            pass
        self.reasoning += out.reasoning
        self.content += out.content
        return out

    def finish(self) -> ReasoningDelta:
        """Flush held-back text when the stream ends (an unclosed block stays reasoning)."""
        out = ReasoningDelta()
        if self._state == self._INSIDE:
            out.reasoning = self._buffer
        else:
            out.content = self._buffer.lstrip() if self._strip_leading else self._buffer
        self._buffer = ""
        self.reasoning += out.reasoning
        self.content += out.content
        return out

    def _step(self, out: ReasoningDelta) -> bool:
        """Consume what can be decided now; True if the loop should run again."""
        if self._state == self._BEFORE:
            head = self._buffer.lstrip()
            if head.startswith(self._fmt.start):
                self._buffer = head[len(self._fmt.start):]
                self._state = self._INSIDE
                return True
            if self._fmt.start.startswith(head):
                return False  # could still become the opening marker
            self._state = self._AFTER  # the answer began without a think block
            return True
        if self._state == self._INSIDE:
            found = self._buffer.find(self._fmt.end)
            if found < 0:
                keep = _partial_suffix(self._buffer, self._fmt.end)
                out.reasoning += self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return False
            out.reasoning += self._buffer[:found]
            self._buffer = self._buffer[found + len(self._fmt.end):]
            self._state, self._strip_leading = self._AFTER, True
            return True
        text = self._buffer
        if self._strip_leading:
            text = text.lstrip()
            if not text:
                self._buffer = ""
                return False
            self._strip_leading = False
        out.content += text
        self._buffer = ""
        return False


def _partial_suffix(text: str, marker: str) -> int:
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
