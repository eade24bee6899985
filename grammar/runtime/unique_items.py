"""`uniqueItems` checked by the matchers: a scanner of the JSON text and the wrappers around a backend grammar.

The schema pass (`schema.unique_items`) compiled the grammar without the
`uniqueItems` it can check and left a plan of the arrays they apply to. Each
matcher follows the JSON text it accepts; a token that would close a string
item equal to an earlier item of the same array is refused (and masked).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from loraplex.grammar.schema.unique_items import UniqueItemsPlan


# ---- the JSON text scanner ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Frame:
    is_object: bool
    path: tuple
    unique: bool = False
    seen: frozenset = frozenset()
    key: str | None = None       # objects: the last key read
    index: int = 0               # arrays: the item being read
    members: frozenset | None = None  # unique arrays of a finite string set: the values (as UTF-8) items may take
    awaiting: bool = False       # arrays: a comma was read, an item must follow


@dataclass(frozen=True, slots=True)
class _State:
    stack: tuple = ()
    in_string: bool = False
    escape: bool = False
    raw: bytes = b""             # the string being read (keys, and items of unique arrays)
    role: str = ""               # "key", "item" (of a unique array) or "" (other strings)
    expect_key: bool = False


_QUOTE, _BACKSLASH = ord('"'), ord("\\")


def _decode(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8") if _BACKSLASH not in raw else json.loads(b'"' + raw + b'"')
    except (UnicodeDecodeError, ValueError):
        return raw.decode("utf-8", errors="replace")


def scan(state: _State, data: bytes, plan: UniqueItemsPlan) -> _State | None:
    """The state after `data`; None when `data` closes a string item equal to an earlier one of its array."""
    stack, in_string, escape, raw, role, expect_key = (state.stack, state.in_string, state.escape, state.raw,
                                                       state.role, state.expect_key)
    i, n = 0, len(data)
    while i < n:
        if in_string:
            if escape:
                escape = False
                if role:
                    raw += data[i:i + 1]
                i += 1
                continue
            # copy a run of plain bytes at once
            j = i
            while j < n and data[j] != _QUOTE and data[j] != _BACKSLASH:
                j += 1
            if role:
                raw += data[i:j]
            i = j
            if i >= n:
                break
            if data[i] == _BACKSLASH:
                escape = True
                if role:
                    raw += b"\\"
                i += 1
                continue
            # closing quote
            in_string = False
            i += 1
            if role == "key" and stack:
                top = stack[-1]
                stack = (*stack[:-1], _Frame(True, top.path, key=_decode(raw)))
            elif role == "item" and stack:
                top = stack[-1]
                value = _decode(raw)
                if value in top.seen:
                    return None
                stack = (*stack[:-1], _Frame(False, top.path, True, top.seen | {value}, index=top.index,
                                             members=top.members))
            raw, role = b"", ""
            continue
        byte = data[i]
        i += 1
        if byte == _QUOTE:
            in_string, escape, raw = True, False, b""
            top = stack[-1] if stack else None
            if top is not None and top.is_object and expect_key:
                role = "key"
            elif top is not None and not top.is_object and top.unique:
                role = "item"
                if top.awaiting:
                    stack = (*stack[:-1], _Frame(False, top.path, True, top.seen, index=top.index,
                                                 members=top.members))
            else:
                role = ""
        elif byte == 0x7B or byte == 0x5B:  # { [
            top = stack[-1] if stack else None
            path = () if top is None else (*top.path, top.key if top.is_object else top.index)
            if byte == 0x7B:
                stack = (*stack, _Frame(True, path))
                expect_key = True
            else:
                stack = (*stack, _Frame(False, path, plan.unique_at(path), members=plan.members_at(path)))
                expect_key = False
        elif byte == 0x7D or byte == 0x5D:  # } ]
            stack = stack[:-1]
            expect_key = False
        elif byte == 0x3A:  # :
            expect_key = False
        elif byte == 0x2C and stack:  # ,
            top = stack[-1]
            if top.is_object:
                expect_key = True
            else:
                stack = (*stack[:-1], _Frame(False, top.path, top.unique, top.seen, index=top.index + 1,
                                             members=top.members, awaiting=True))
    return _State(stack, in_string, escape, raw, role, expect_key)


def may_close_duplicate(state: _State) -> bool:
    """Whether a token could close a duplicate item from here (inside a string item of a non-empty unique set)."""
    return state.in_string and state.role == "item" and bool(state.stack[-1].seen)


def can_finish(state: _State) -> bool:
    """In a unique array over a finite set of strings, some value is still unused for the item being read (the
    text so far begins it) or the one a comma asked for; elsewhere always. Masking what fails this is what keeps
    the duplicate check from leaving generation without a way on."""
    top = state.stack[-1] if state.stack else None
    if top is None or top.is_object or top.members is None or not top.seen:
        return True
    if state.in_string and state.role == "item":
        return any(text.startswith(state.raw) and value not in top.seen for text, value in top.members)
    if not state.in_string and top.awaiting:
        return any(value not in top.seen for _, value in top.members)
    return True


def next_state(state: _State, data: bytes, plan: UniqueItemsPlan) -> _State | None:
    """The state after `data`, or None when `data` closes a duplicate or leaves no unused value to write."""
    after = scan(state, data, plan)
    return after if after is not None and can_finish(after) else None


# ---- the backend wrappers ------------------------------------------------------------------------------------
class UniqueItemsGrammar:
    """A backend grammar compiled without the checked `uniqueItems`, and the plan that checks them."""

    __slots__ = ("_inner", "_plan", "_tokens", "backend", "memory_size_bytes")

    def __init__(self, inner: Any, plan: UniqueItemsPlan, tokens: TokenBytes) -> None:
        self._inner = inner
        self._plan = plan
        self._tokens = tokens
        self.backend = inner.backend
        self.memory_size_bytes = inner.memory_size_bytes

    def new_matcher(self) -> UniqueItemsMatcher:
        return UniqueItemsMatcher(self._inner.new_matcher(), self._plan, self._tokens)


class TokenBytes:
    """The bytes of every token, and the tokens that hold a quote (the only ones that can close a string)."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        self.data = token_bytes
        self.quoted = torch.tensor([i for i, b in enumerate(token_bytes) if b'"' in b], dtype=torch.int64)


class UniqueItemsMatcher:
    __slots__ = ("_history", "_inner", "_plan", "_tokens")

    def __init__(self, inner: Any, plan: UniqueItemsPlan, tokens: TokenBytes) -> None:
        self._inner = inner
        self._plan = plan
        self._tokens = tokens
        self._history: list[_State] = [_State()]

    def _next(self, token_id: int) -> _State | None:
        data = self._tokens.data[token_id] if 0 <= token_id < len(self._tokens.data) else b""
        return next_state(self._history[-1], data, self._plan)

    def accept_token(self, token_id: int) -> bool:
        state = self._next(token_id)
        if state is None or not self._inner.accept_token(token_id):
            return False
        self._history.append(state)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._inner.rollback(num_tokens)
            del self._history[-num_tokens:]

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._inner.fill_bitmask(bitmask, row)
        state = self._history[-1]
        top = state.stack[-1] if state.stack else None
        if top is not None and not top.is_object and top.members is not None and top.seen:
            candidates = _allowed(bitmask[row], len(self._tokens.data))  # finite values: any token may matter
        elif may_close_duplicate(state):
            quoted = self._tokens.quoted
            candidates = quoted[quoted < bitmask.shape[1] * 32]
            words = bitmask[row]
            allowed = (((words[candidates // 32].to(torch.int64) & 0xFFFFFFFF) >> (candidates % 32)) & 1)
            candidates = candidates[allowed.nonzero().flatten()]
        else:
            return
        words = bitmask[row]
        for token_id in candidates.tolist():
            if next_state(state, self._tokens.data[token_id], self._plan) is None:
                word, bit = divmod(token_id, 32)
                value = (int(words[word]) & 0xFFFFFFFF) & ~(1 << bit)
                words[word] = value - (1 << 32) if value >= 1 << 31 else value

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_terminated(self) -> bool:
        return self._inner.is_terminated()

    def forced_token_ids(self) -> list[int]:
        forced = self._inner.forced_token_ids()
        state = self._history[-1]
        for i, token_id in enumerate(forced):
            data = self._tokens.data[token_id] if 0 <= token_id < len(self._tokens.data) else b""
            state = next_state(state, data, self._plan)
            if state is None:
                return forced[:i]
        return forced


_BIT_POSITIONS = torch.arange(32, dtype=torch.int64)


def _allowed(words: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The token ids whose bit is set in one bitmask row (ids past the tokenizer's vocabulary left out)."""
    bits = ((words.to(torch.int64).unsqueeze(1) & 0xFFFFFFFF) >> _BIT_POSITIONS) & 1
    ids = bits.flatten().nonzero().flatten()
    return ids[ids < num_tokens]
