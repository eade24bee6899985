"""`uniqueItems` checked by the matchers: a scanner of the JSON text and the wrappers around a backend grammar.

The schema pass (`schema.unique_items`) compiled the grammar without the
`uniqueItems` it can check and left a plan of the arrays they apply to. Each
matcher follows the JSON text it accepts; a token that would close a string
item, an item object, or a number item, equal to an earlier item of the same
array is refused (and masked). Objects are compared as JSON values (keys in any
order, 1 and 1.0 one number); a number is closed by the `,` or `]` after it,
and in an array of integers a leading `0` (the integer 0, signed or not) is
refused at once when 0 was an item already, since nothing can follow it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from decimal import Decimal, InvalidOperation
from typing import Any

import torch
from loraplex.grammar.runtime.unique_members import MemberIndex, member_index
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
    members: MemberIndex | None = None  # unique arrays of a finite string set: the values (as UTF-8) items may take
    awaiting: bool = False       # arrays: a comma was read, an item must follow
    objects: bool = False        # unique arrays of open objects: each item object is compared whole
    start: int = -1              # objects that are such an item: where their text starts
    numbers: str = ""            # unique arrays of "integer" or "number" items: each compared once the byte after
                                 # it comes


@dataclass(frozen=True, slots=True)
class _State:
    stack: tuple = ()
    in_string: bool = False
    escape: bool = False
    raw: bytes = b""             # the string being read (keys, and items of unique arrays)
    role: str = ""               # "key", "item" (of a unique array) or "" (other strings)
    expect_key: bool = False
    offset: int = 0              # bytes read so far
    number: bytes = b""          # the number item being read (its text so far)


_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_NUMBER_BYTES = frozenset(b"-+.eE0123456789")


def _decode(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8") if _BACKSLASH not in raw else json.loads(b'"' + raw + b'"')
    except (UnicodeDecodeError, ValueError):
        return raw.decode("utf-8", errors="replace")


class _SeenAndOne:
    """An array's seen values and one more, without copying them: a candidate token is checked, then dropped, and
    copying a long array's values for each of hundreds of candidates made a mask fill quadratic in the array."""

    __slots__ = ("base", "value")

    def __init__(self, base: Any, value: Any) -> None:
        self.base = base
        self.value = value

    def __contains__(self, value: Any) -> bool:
        return value == self.value or value in self.base

    def __bool__(self) -> bool:
        return True


def _with(seen: Any, value: Any, keep: bool) -> Any:
    return seen | {value} if keep else _SeenAndOne(seen, value)


def scan(state: _State, data: bytes, plan: UniqueItemsPlan, before: bytes | bytearray = b"",
         keep: bool = True) -> _State | None:
    """The state after `data` (`before`: the text read so far); None when `data` closes an item equal to an
    earlier one of its array. `keep`: the state is kept (accepted), not only checked."""
    stack, in_string, escape, raw, role, expect_key = (state.stack, state.in_string, state.escape, state.raw,
                                                       state.role, state.expect_key)
    number = state.number
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
                stack = (*stack[:-1], replace(top, key=_decode(raw)))
            elif role == "item" and stack:
                top = stack[-1]
                value = _decode(raw)
                if value in top.seen:
                    return None
                stack = (*stack[:-1], replace(top, seen=_with(top.seen, value, keep)))
            raw, role = b"", ""
            continue
        byte = data[i]
        i += 1
        top = stack[-1] if stack else None
        if top is not None and top.numbers:
            if byte in _NUMBER_BYTES:
                if top.numbers == "integer" and byte == 0x30 and number in (b"", b"-") and 0 in top.seen:
                    return None  # the integer 0 again: no digit may follow a leading 0
                number += data[i - 1:i]
                continue
            if number:
                value = _number_value(number)
                if value in top.seen:
                    return None
                stack, number = (*stack[:-1], replace(top, seen=_with(top.seen, value, keep))), b""
        if byte == _QUOTE:
            in_string, escape, raw = True, False, b""
            top = stack[-1] if stack else None
            if top is not None and top.is_object and expect_key:
                role = "key"
            elif top is not None and not top.is_object and top.unique:
                role = "item"
                if top.awaiting:
                    stack = (*stack[:-1], replace(top, awaiting=False))
            else:
                role = ""
        elif byte == 0x7B or byte == 0x5B:  # { [
            top = stack[-1] if stack else None
            path = () if top is None else (*top.path, top.key if top.is_object else top.index)
            if byte == 0x7B:
                item = top is not None and not top.is_object and top.objects
                stack = (*stack, _Frame(True, path, start=state.offset + i - 1 if item else -1))
                expect_key = True
            else:
                unique = plan.unique_at(path)
                stack = (*stack, _Frame(False, path, unique, members=member_index(plan.members_at(path)),
                                        objects=unique and plan.objects_at(path),
                                        numbers=plan.numbers_at(path) if unique else ""))
                expect_key = False
        elif byte == 0x7D or byte == 0x5D:  # } ]
            closed, stack = stack[-1] if stack else None, stack[:-1]
            expect_key = False
            if closed is not None and closed.start >= 0 and stack:
                text = before[closed.start:] + data[:i] if closed.start < state.offset else \
                    data[closed.start - state.offset:i]
                value = _canonical_text(text)
                array = stack[-1]
                if value in array.seen:
                    return None
                stack = (*stack[:-1], replace(array, seen=_with(array.seen, value, keep)))
        elif byte == 0x3A:  # :
            expect_key = False
        elif byte == 0x2C and stack:  # ,
            top = stack[-1]
            if top.is_object:
                expect_key = True
            else:
                stack = (*stack[:-1], replace(top, index=top.index + 1, awaiting=True))
    return _State(stack, in_string, escape, raw, role, expect_key, state.offset + n, number)


def _number_value(text: bytes) -> Any:
    """The exact value of a JSON number (1 and 1.0 one value; 1e400 and 1e500 two, as JSON Schema has it and as
    floats would not: a digit appended always makes a new value, which is what keeps generation going)."""
    try:
        return Decimal(text.decode("ascii"))
    except (InvalidOperation, UnicodeDecodeError):
        return ("unread", text)


def _canonical_text(text: bytes | bytearray) -> Any:
    try:
        return _canonical(json.loads(text))
    except (ValueError, RecursionError):
        return ("unread", bytes(text))


def _canonical(value: Any) -> Any:
    """A hashable form in which two JSON values are equal exactly when JSON Schema calls them equal (keys in any
    order, 1 and 1.0 one number, true never 1)."""
    if isinstance(value, dict):
        return ("object", tuple(sorted((k, _canonical(v)) for k, v in value.items())))
    if isinstance(value, list):
        return ("array", tuple(_canonical(v) for v in value))
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return (type(value).__name__, value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return ("number", value)


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
        return top.members.has_unused(state.raw, top.seen)
    if not state.in_string and top.awaiting:
        return top.members.has_unused(b"", top.seen)
    return True


def in_number_set(state: _State) -> bool:
    """Whether the text is at an item of a unique number array that already holds one (a `,` or `]` may close a
    duplicate, a `0` may begin the integer 0)."""
    top = state.stack[-1] if state.stack else None
    return not state.in_string and top is not None and bool(top.numbers) and bool(top.seen)


def closes_item_object(state: _State) -> bool:
    """Whether a `}` could close an item object of a unique array that already holds one (the whole item is
    compared then)."""
    return any(frame.start >= 0 and i > 0 and state.stack[i - 1].seen for i, frame in enumerate(state.stack))


def next_state(state: _State, data: bytes, plan: UniqueItemsPlan, before: bytes | bytearray = b"",
               keep: bool = True) -> _State | None:
    """The state after `data`, or None when `data` closes a duplicate or leaves no unused value to write."""
    after = scan(state, data, plan, before, keep)
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
    """The bytes of every token, and the tokens that hold a quote, a `}`, or one of `,`, `]`, `0` (the only ones
    that can close a string, an object, or a number, or begin the integer 0)."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        self.data = token_bytes
        self.quoted = torch.tensor([i for i, b in enumerate(token_bytes) if b'"' in b], dtype=torch.int64)
        self.braced = torch.tensor([i for i, b in enumerate(token_bytes) if b"}" in b], dtype=torch.int64)
        self.numeric = torch.tensor([i for i, b in enumerate(token_bytes) if b"," in b or b"]" in b or b"0" in b],
                                    dtype=torch.int64)


class UniqueItemsMatcher:
    __slots__ = ("_history", "_inner", "_plan", "_text", "_tokens")

    def __init__(self, inner: Any, plan: UniqueItemsPlan, tokens: TokenBytes) -> None:
        self._inner = inner
        self._plan = plan
        self._tokens = tokens
        self._history: list[_State] = [_State()]
        self._text = bytearray()  # what was accepted: an item object is compared whole once closed

    def _next(self, token_id: int) -> _State | None:
        return next_state(self._history[-1], self._bytes(token_id), self._plan, self._text)

    def _bytes(self, token_id: int) -> bytes:
        return self._tokens.data[token_id] if 0 <= token_id < len(self._tokens.data) else b""

    def accept_token(self, token_id: int) -> bool:
        state = self._next(token_id)
        if state is None or not self._inner.accept_token(token_id):
            return False
        self._history.append(state)
        self._text += self._bytes(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._inner.rollback(num_tokens)
            del self._history[-num_tokens:]
            del self._text[self._history[-1].offset:]

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._inner.fill_bitmask(bitmask, row)
        state = self._history[-1]
        top = state.stack[-1] if state.stack else None
        if top is not None and not top.is_object and top.members is not None and top.seen:
            candidates = _allowed(bitmask[row], len(self._tokens.data))  # finite values: any token may matter
        elif may_close_duplicate(state) or closes_item_object(state) or in_number_set(state):
            closers = (self._tokens.quoted if may_close_duplicate(state) else self._tokens.numeric
                       if in_number_set(state) else self._tokens.braced)
            candidates = closers[closers < bitmask.shape[1] * 32]
            words = bitmask[row]
            allowed = (((words[candidates // 32].to(torch.int64) & 0xFFFFFFFF) >> (candidates % 32)) & 1)
            candidates = candidates[allowed.nonzero().flatten()]
        else:
            return
        words = bitmask[row]
        before, data = self._text, self._tokens.data
        # Inside a string item of a finite set, a token with no quote or backslash only lengthens the text: it is
        # allowed when some unused value begins with the text it makes (one bisection, no scan).
        members = top.members if top is not None and state.in_string and state.role == "item" else None
        plain = members is not None and not state.escape
        for token_id in candidates.tolist():
            token = data[token_id]
            if plain and _QUOTE not in token and _BACKSLASH not in token:
                allowed_here = members.has_unused(state.raw + token, top.seen)  # type: ignore[union-attr]
            else:
                allowed_here = next_state(state, token, self._plan, before, keep=False) is not None
            if not allowed_here:
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
        before = bytearray(self._text) if self._plan.objects_anywhere else bytearray()
        for i, token_id in enumerate(forced):
            data = self._bytes(token_id)
            after = next_state(state, data, self._plan, before)
            if after is None:
                return forced[:i]
            state = after
            if self._plan.objects_anywhere:
                before += data
        return forced


_BIT_POSITIONS = torch.arange(32, dtype=torch.int64)


def _allowed(words: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The token ids whose bit is set in one bitmask row (ids past the tokenizer's vocabulary left out)."""
    bits = ((words.to(torch.int64).unsqueeze(1) & 0xFFFFFFFF) >> _BIT_POSITIONS) & 1
    ids = bits.flatten().nonzero().flatten()
    return ids[ids < num_tokens]
