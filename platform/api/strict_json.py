"""JSON bodies as the API accepts them: Python's parser, less the strings that are not Unicode text.

JSON lets a string hold `\\ud800`, half of a UTF-16 surrogate pair, on its own. Python's `json.loads` turns
it into a `str` that cannot be encoded: the tokenizer refuses it (a 500 on a chat request, reached after
admission), and so would PostgreSQL, Redis clients and the grammar compiler wherever such a string went.
Such a body is refused here, as a 400 for malformed JSON, before any route sees it. So are two bodies
Python's parser refuses with errors other than `JSONDecodeError` (which FastAPI would answer with a bare
"error parsing the body"): JSON nested deeper than the parser's recursion allows (~1,000 levels), and an
integer of more digits than Python converts (4,300).

Every API router is built on `StrictJSONRoute`; `loads_strict` serves the other JSON a tenant sends (the
lines of a batch input file).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

# Only an escape can make a lone surrogate (raw surrogate bytes are not UTF-8 and fail decoding), so a body
# without one is not checked further.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
NESTED_TOO_DEEP = "arrays and objects nest deeper than the parser allows (about 1,000 levels)"


def loads_strict(raw: bytes) -> Any:
    """`json.loads` of a body as received, raising `json.JSONDecodeError` for a string (key or value) holding a
    lone surrogate, nesting too deep to parse or an integer too long to convert."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise json.JSONDecodeError(NESTED_TOO_DEEP, "", 0) from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # int() past sys.get_int_max_str_digits()
        raise json.JSONDecodeError(f"a number is too long to read ({exc})", "", 0) from None
    match = _SURROGATE_ESCAPE.search(raw)
    if match is not None and _holds_lone_surrogate(value):
        raise json.JSONDecodeError("a string holds a lone UTF-16 surrogate escape, which is not Unicode text",
                                   raw.decode("utf-8", "replace"), match.start())
    return value


def _holds_lone_surrogate(value: Any) -> bool:
    """Whether any string in `value` (keys included) cannot be encoded: one C-level pass, not a walk in Python
    (a body with many escaped non-ASCII characters, as `ensure_ascii` clients send, holds escapes throughout)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads_strict(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """A route whose JSON body is parsed by `loads_strict` (FastAPI's documented custom-request pattern)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler
