"""`format`, enforced or refused, never taken for an annotation where JSON Schema gives it a meaning.

JSON Schema defines a fixed vocabulary of formats (`DEFINED_FORMATS`, drafts
4 to 2020-12, and draft 3's own when the schema declares draft 3). Each one,
wherever it sits, ends in one of three ways:
- the backends enforce it (`BACKEND_FORMATS`: llguidance checks these
  itself; the compiler refuses a schema whose backend does not);
- it is written here as the exact `pattern` of its RFC grammar
  (`FORMAT_PATTERNS`: json-pointer, relative-json-pointer, uri-template,
  uri-reference, iri, iri-reference), which every backend enforces;
- neither (idn-email, idn-hostname, regex, draft 3's color, style, phone):
  it stays, no backend enforces it, and a strict schema is refused with a
  400 naming `format: X` and where it is.
A format no draft defines (`int32`, `textarea`, ...) names nothing a
validator could check (validators ignore unknown formats), so it is dropped
as the annotation it is; so is a format on a subschema that admits no string
(a format constrains strings only).
"""

from __future__ import annotations

import copy
from typing import Any

from loraplex.grammar.schema.walk import DEFINED_FORMATS, subschemas

# Draft 3's formats, defined only where the root declares draft 3: aliases are renamed, utc-millisec (any number)
# constrains nothing, the others stay (and are refused).
_DRAFT3_RENAMED = {"host-name": "hostname", "ip-address": "ipv4"}
_DRAFT3_FORMATS = frozenset({"utc-millisec", "color", "style", "phone", *_DRAFT3_RENAMED})
_DRAFT3_UNCONSTRAINED = frozenset({"utc-millisec"})

# What the JSON-schema backend enforces itself (llguidance's formats, as its instance tests check).
BACKEND_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                             "uuid"})


# ---- RFC 3986 (URI) and RFC 3987 (IRI), as regular expressions ------------------------------------------------
def _one_of(*alternatives: str) -> str:
    return "(?:" + "|".join(alternatives) + ")"


_HEX = "[0-9A-Fa-f]"
_PCT = f"%{_HEX}{_HEX}"
_SUB_DELIMS = "!$&'()*+,;="
_DEC_OCTET = _one_of("25[0-5]", "2[0-4][0-9]", "1[0-9][0-9]", "[1-9][0-9]", "[0-9]")
_IPV4 = rf"{_DEC_OCTET}\.{_DEC_OCTET}\.{_DEC_OCTET}\.{_DEC_OCTET}"
_H16 = f"{_HEX}{{1,4}}"
_LS32 = _one_of(f"{_H16}:{_H16}", _IPV4)


def _h16s(count: int) -> str:
    """Up to `count` h16 groups followed by colons, then one more: `[ *n( h16 ":" ) h16 ]`."""
    return f"(?:(?:{_H16}:){{0,{count}}}{_H16})?"


_IPV6 = _one_of(
    f"(?:{_H16}:){{6}}{_LS32}",
    f"::(?:{_H16}:){{5}}{_LS32}",
    f"(?:{_H16})?::(?:{_H16}:){{4}}{_LS32}",
    f"{_h16s(1)}::(?:{_H16}:){{3}}{_LS32}",
    f"{_h16s(2)}::(?:{_H16}:){{2}}{_LS32}",
    f"{_h16s(3)}::{_H16}:{_LS32}",
    f"{_h16s(4)}::{_LS32}",
    f"{_h16s(5)}::{_H16}",
    f"{_h16s(6)}::",
)
# ucschar and iprivate of RFC 3987, as literal characters (surrogates are not characters and never appear).
_UCSCHAR = ("\u00a0-\ud7ff\uf900-\ufdcf\ufdf0-\uffef" + "".join(
    f"{chr(plane << 16)}-{chr((plane << 16) + 0xFFFD)}" for plane in range(1, 14)) + "\U000e1000-\U000efffd")
_IPRIVATE = "\ue000-\uf8ff\U000f0000-\U000ffffd\U00100000-\U0010fffd"


def _uri_grammar(iri: bool) -> dict[str, str]:
    unreserved = "A-Za-z0-9._~\\-" + (_UCSCHAR if iri else "")
    pchar = _one_of(f"[{unreserved}{_SUB_DELIMS}:@]", _PCT)
    segment_nz_nc = _one_of(f"[{unreserved}{_SUB_DELIMS}@]", _PCT) + "+"
    userinfo = _one_of(f"[{unreserved}{_SUB_DELIMS}:]", _PCT) + "*"
    reg_name = _one_of(f"[{unreserved}{_SUB_DELIMS}]", _PCT) + "*"  # IPv4 addresses are reg-names too
    ip_future = rf"v{_HEX}+\.[A-Za-z0-9._~{_SUB_DELIMS}:-]+"
    host = _one_of(rf"\[{_one_of(_IPV6, ip_future)}\]", reg_name)
    authority = f"(?:{userinfo}@)?{host}(?::[0-9]*)?"
    segment = f"{pchar}*"
    path_abempty = f"(?:/{segment})*"
    path_absolute = f"/(?:{pchar}+(?:/{segment})*)?"
    path_noscheme = f"{segment_nz_nc}(?:/{segment})*"
    path_rootless = f"{pchar}+(?:/{segment})*"
    query = _one_of(pchar, "[/?]" if not iri else f"[/?{_IPRIVATE}]") + "*"
    fragment = _one_of(pchar, "[/?]") + "*"
    tail = f"(?:\\?{query})?(?:#{fragment})?"
    scheme = "[A-Za-z][A-Za-z0-9+.-]*"
    absolute = f"{scheme}:{_one_of(f'//{authority}{path_abempty}', path_absolute, path_rootless, '')}{tail}"
    relative = f"{_one_of(f'//{authority}{path_abempty}', path_absolute, path_noscheme, '')}{tail}"
    return {"absolute": absolute, "reference": _one_of(absolute, relative)}


_URI, _IRI = _uri_grammar(iri=False), _uri_grammar(iri=True)

# RFC 6570 (URI Template), levels 1 to 4.
_VARCHAR = _one_of("[A-Za-z0-9_]", _PCT)
_VARSPEC = rf"{_VARCHAR}(?:\.?{_VARCHAR})*(?::[1-9][0-9]{{0,3}}|\*)?"
_EXPRESSION = rf"\{{[+#./;?&=,!@|]?{_VARSPEC}(?:,{_VARSPEC})*\}}"
_TEMPLATE_LITERAL = _one_of("[!#$&()*+,\\-./0-9:;=?@A-Z\\[\\]_a-z~" + _UCSCHAR + _IPRIVATE + "]", _PCT)

# RFC 6901 (JSON Pointer) and draft-handrews-relative-json-pointer-01.
_JSON_POINTER = "(?:/(?:[^~/]|~[01])*)*"

FORMAT_PATTERNS: dict[str, str] = {
    "json-pointer": f"^{_JSON_POINTER}$",
    "relative-json-pointer": f"^(?:0|[1-9][0-9]*)(?:#|{_JSON_POINTER})$",
    "uri-template": f"^{_one_of(_TEMPLATE_LITERAL, _EXPRESSION)}*$",
    "uri-reference": f"^{_URI['reference']}$",
    "iri": f"^{_IRI['absolute']}$",
    "iri-reference": f"^{_IRI['reference']}$",
}


# ---- the pass ---------------------------------------------------------------------------------------------------
def with_formats_enforced(schema: Any) -> Any:
    """`schema` (a copy when anything changes) with annotation formats dropped and those with an exact pattern
    written as that pattern; every other defined format stays for the backends to enforce or refuse."""
    if not any(isinstance(node, dict) and "format" in node for _, node, _ in subschemas(schema)):
        return schema
    draft3 = isinstance(schema, dict) and "draft-03" in str(schema.get("$schema", ""))
    schema = copy.deepcopy(schema)
    for _, node, _ in subschemas(schema):
        if isinstance(node, dict) and "format" in node:
            _rewrite_format(node, draft3)
    return schema


def _rewrite_format(node: dict, draft3: bool) -> None:
    fmt = node["format"]
    if draft3 and fmt in _DRAFT3_RENAMED:
        fmt = node["format"] = _DRAFT3_RENAMED[fmt]
    defined = isinstance(fmt, str) and (fmt in DEFINED_FORMATS or (draft3 and fmt in _DRAFT3_FORMATS))
    if not defined or fmt in _DRAFT3_UNCONSTRAINED or not _admits_strings(node):
        del node["format"]
        return
    pattern = FORMAT_PATTERNS.get(fmt)
    if pattern is None:
        return
    del node["format"]
    if "pattern" in node:  # both must hold: the second pattern joins as an allOf member
        node["allOf"] = [*node.get("allOf", []), {"pattern": pattern}]
    else:
        node["pattern"] = pattern


def _admits_strings(node: dict) -> bool:
    declared = node.get("type")
    if isinstance(declared, str):
        return declared == "string"
    if isinstance(declared, list):
        return "string" in declared
    return True
