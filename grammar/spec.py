"""What a request asks the output to match, as plain data with a content key.

A `GrammarSpec` is the one value the compile cache is keyed by: two requests
whose specs are equal as canonical JSON share one compiled grammar, whatever
the order of keys or whitespace the clients sent.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any


class GrammarKind:
    JSON_OBJECT = "json_object"        # any JSON object
    JSON_SCHEMA = "json_schema"        # payload: the schema (dict)
    REGEX = "regex"                    # payload: the pattern
    EBNF = "ebnf"                      # payload: GBNF/EBNF text with a `root` rule
    CHOICE = "choice"                  # payload: list of strings, output is exactly one of them
    STRUCTURAL_TAG = "structural_tag"  # payload: an xgrammar structural tag (dict); tool calls


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: str
    payload: Any = None
    param: str = "response_format"  # the request field a compile error is reported against
    # JSON schemas only: strict refuses a schema no backend enforces exactly; otherwise the
    # closest backend serves it and the relaxed keyword is reported (GrammarCompilerService).
    strict: bool = False

    def canonical_json(self) -> str:
        return json.dumps(
            {"kind": self.kind, "payload": self.payload, "strict": self.strict},
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
        )

    def cache_key(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def size_bytes(self) -> int:
        return len(self.canonical_json().encode())


def ebnf_string_literal(text: str) -> str:
    """Quote `text` as an EBNF string literal xgrammar reads back byte for byte."""
    out = ['"']
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(ebnf_string_literal(c) for c in choices)
