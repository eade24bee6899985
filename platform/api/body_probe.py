"""Counts in a large JSON body, read without building it: lists and maps past their limit are refused unparsed.

Parsing a body builds a Python object for every value in it: 20,000 tools in
a 1.7 MB body cost 70-190 ms of the event loop (every tenant's requests wait
meanwhile), only for the request to be refused for its tool count. msgspec
scans the same body in a few milliseconds, keeping the fields whose counts
the edge limits (`tools`, `logit_bias`, `stop`, `messages`, `prompt`, and the
Responses API's `input`, whose items count as messages) as raw
slices and splitting only those into raw elements to count them. A body that
is malformed or has an unexpected shape is left to the normal parser, which
reports it as usual; one nested too deep to scan is refused here, as that
parser would refuse it.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from loraplex.platform.api.request_limits import RequestLimits
from loraplex.platform.api.strict_json import NESTED_TOO_DEEP

PROBE_MIN_BYTES = 64 * 1024  # smaller bodies parse in well under a millisecond: not worth a second pass
PROBED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
_NULL = msgspec.Raw(b"null")


class _CountedFields(msgspec.Struct):
    tools: msgspec.Raw = _NULL
    logit_bias: msgspec.Raw = _NULL
    stop: msgspec.Raw = _NULL
    messages: msgspec.Raw = _NULL
    prompt: msgspec.Raw = _NULL
    input: msgspec.Raw = _NULL


_FIELDS = msgspec.json.Decoder(_CountedFields)
_LIST = msgspec.json.Decoder(list[msgspec.Raw] | str | None)
_MAP = msgspec.json.Decoder(dict[str, msgspec.Raw] | None)


@dataclass(frozen=True, slots=True)
class Refusal:
    message: str
    param: str | None


def probe_counts(body: bytes, limits: RequestLimits, *, max_tools: int) -> Refusal | None:
    """The first counted field past its limit, or None (also for bodies the normal parser must judge)."""
    try:
        fields = _FIELDS.decode(body)
        tools = _LIST.decode(fields.tools)
        if isinstance(tools, list) and len(tools) > max_tools:
            return Refusal(f"tools holds {len(tools)} tools; the limit is {max_tools}", "tools")
        for name, limit, what in (("stop", limits.max_stop_sequences, "stop sequences"),
                                  ("messages", limits.max_messages, "messages"),
                                  ("prompt", limits.max_prompts, "prompts"),
                                  ("input", limits.max_messages, "items")):
            items = _LIST.decode(getattr(fields, name))
            if isinstance(items, list) and len(items) > limit and not (name == "prompt" and _token_ids(items)):
                return Refusal(f"{name} allows at most {limit} {what}; got {len(items)}", name)
        # Each entry of a map of numbers holds one ':' outside strings: a cheap upper bound before counting.
        if bytes(fields.logit_bias).count(b":") > limits.max_logit_bias_entries:
            bias = _MAP.decode(fields.logit_bias)
            if bias is not None and len(bias) > limits.max_logit_bias_entries:
                return Refusal(f"logit_bias allows at most {limits.max_logit_bias_entries} entries; got {len(bias)}",
                               "logit_bias")
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    except RecursionError:
        return Refusal(f"the request body is not valid JSON: {NESTED_TOO_DEEP}", None)
    return None


def _token_ids(items: list[msgspec.Raw]) -> bool:
    """A prompt given as one list of token ids is one prompt, however long."""
    first = bytes(items[0]).strip()
    return first[:1].isdigit() or first[:1] == b"-"
