"""truncation="auto": which of the oldest turns to leave out, from each turn's tokens counted once.

A turn is a user message and what follows it up to the next one. Every
message of the history is tokenized once, in one batch, and the turns' costs
are summed as prefix sums; a prompt that is `excess` tokens too long drops
the fewest oldest turns whose cost covers it. The chat template adds a few
tokens per message (role markers), measured once per tokenizer and role. Counts are an
estimate of the rendered prompt (a tokenizer may merge across a boundary), so
the caller renders the planned prompt and, if it is still too long, plans
again from the new excess: each round drops at least one more turn.
"""

from __future__ import annotations

import bisect
import itertools
import json
from dataclasses import dataclass
from typing import Any

_OVERHEADS: dict[tuple[str, str, str], int] = {}  # (tokenizer, template, role) -> tokens a message adds


@dataclass(frozen=True, slots=True)
class TurnCosts:
    starts: list[int]        # the history index each droppable turn starts at
    cumulative: list[int]    # cumulative[k]: tokens of the first k turns (cumulative[0] == 0)
    num_messages: int        # the history's length

    @property
    def num_tokens(self) -> int:
        return self.cumulative[-1]

    def num_tokens_before(self, num_messages: int) -> int:
        """Tokens of the turns wholly within the first `num_messages` history messages."""
        if num_messages >= self.num_messages:
            return self.num_tokens
        return self.cumulative[bisect.bisect_right(self.starts, num_messages) - 1] if self.starts else 0

    def num_messages_to_drop(self, *, num_dropped: int, excess: int) -> int:
        """How many leading history messages to leave out: `num_dropped` and then the fewest further turns
        whose tokens cover `excess` (the whole history when they cannot)."""
        if excess <= 0:
            return num_dropped
        first = bisect.bisect_left(self.starts, num_dropped)  # the first turn not yet dropped
        k = bisect.bisect_left(self.cumulative, self.cumulative[first] + excess, lo=first + 1)
        return self.starts[k] if k < len(self.starts) else self.num_messages


def turn_starts(history: list[dict[str, Any]]) -> list[int]:
    """Index 0, then each user message after it: what ResponseTurn.truncate leaves out one at a time."""
    return [0, *(i for i, message in enumerate(history) if i and message.get("role") == "user")]


def message_text(message: dict[str, Any]) -> str:
    """The text a message contributes to a prompt: its content and any tool calls' names and arguments."""
    parts = [message.get("content") or ""]
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        parts.append(json.dumps({"name": function.get("name"), "arguments": function.get("arguments")}))
    return "".join(parts)


def per_message_overhead(tokenizer: Any, role: str) -> int:
    """Tokens a chat template adds to a message of `role` beside its text (role markers, separators)."""
    key = (str(getattr(tokenizer, "name_or_path", "")), str(getattr(tokenizer, "chat_template", "")), role)
    if key not in _OVERHEADS:
        probe = [{"role": "user", "content": "x"}, {"role": role, "content": "y"}]
        try:
            one, two = (_num_rendered(tokenizer, probe[:n]) for n in (1, 2))
            _OVERHEADS[key] = max(0, two - one - len(tokenizer("y", add_special_tokens=False)["input_ids"]))
        except Exception:  # a template that refuses the probe: count text only (the render check still holds)
            _OVERHEADS[key] = 0
    return _OVERHEADS[key]


def _num_rendered(tokenizer: Any, messages: list[dict[str, Any]]) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def turn_costs(tokenizer: Any, history: list[dict[str, Any]]) -> TurnCosts:
    """Each turn's tokens, every message tokenized once (one batch)."""
    if not history:
        return TurnCosts(starts=[], cumulative=[0], num_messages=0)
    texts = [message_text(m) for m in history]
    counts = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    per_message = [n + per_message_overhead(tokenizer, str(m.get("role"))) for n, m in zip(counts, history, strict=True)]
    starts = turn_starts(history)
    bounds = [*starts, len(history)]
    per_turn = [sum(per_message[bounds[i]:bounds[i + 1]]) for i in range(len(starts))]
    return TurnCosts(starts=starts, cumulative=[0, *itertools.accumulate(per_turn)], num_messages=len(history))
