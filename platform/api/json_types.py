"""Scalar types of request bodies that take JSON's types as sent, as OpenAI's API does.

Pydantic's lax mode reads `"stream": "yes"` as true, `"seed": "1"` as 1 and
`"max_tokens": true` as 1: a client's bug then runs as something it did not
ask for (an unwanted stream, a fixed seed) instead of failing where it can be
seen. These types refuse a string or a boolean where a number goes, and
anything but true or false where a boolean goes, with the usual 400 naming
the field. A whole number written as a float (`16.0`) is still an integer,
as JSON does not tell them apart.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Strict
from pydantic_core import PydanticCustomError


def _refuse_text_and_booleans(kind: str) -> BeforeValidator:
    def check(value: Any) -> Any:
        if isinstance(value, str | bytes | bytearray):
            raise PydanticCustomError(f"{kind}_type", f"Input should be a valid {kind}, not a string")
        if isinstance(value, bool):
            raise PydanticCustomError(f"{kind}_type", f"Input should be a valid {kind}, not a boolean")
        return value

    return BeforeValidator(check)


JSONBool = Annotated[bool, Strict()]
JSONInt = Annotated[int, _refuse_text_and_booleans("integer")]
JSONFloat = Annotated[float, _refuse_text_and_booleans("number")]
