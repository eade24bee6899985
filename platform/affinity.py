"""Session affinity a gateway can key on: the session in a header, both ways.

A load balancer in front of several replicas sees headers, not bodies. So:

- a request may name its session (`x-session-id: sess_...`, chat completions)
  or the response it continues (`x-previous-response-id: resp_...`, the
  Responses API) in a header instead of the body; both given and different
  is a 400 naming the body's parameter. Other `x-session-id` values are the
  client's own routing keys: ignored here, echoed back;
- a session's turns, a session's creation and every Responses answer carry
  `x-session-id`: the key a balancer hashes or sticks on (the session id; for
  a Responses chain its first response's id, the same for every turn), or
  the key the client sent. An incoming `x-session-token` (llm-d's
  session-affinity scorer) is echoed back.

A turn that lands on another replica anyway is served there from the
transcript (its KV is prefilled again) and counted in
`loraplex_session_turns_moved_total`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraplex.engine.errors import InvalidRequestError

SESSION_HEADER = "x-session-id"
TOKEN_HEADER = "x-session-token"
PREVIOUS_RESPONSE_HEADER = "x-previous-response-id"
MAX_HEADER_CHARS = 256  # longer values are not echoed


def session_id_from(headers: Mapping[str, str], body_value: str | None) -> str | None:
    """The chat request's session: the body's `session_id`, else an `x-session-id: sess_...` header."""
    return _from_header(headers.get(SESSION_HEADER), body_value, prefix="sess_", param="session_id")


def previous_response_id_from(headers: Mapping[str, str], body_value: str | None) -> str | None:
    """The response continued: the body's `previous_response_id`, else the `x-previous-response-id` header."""
    return _from_header(headers.get(PREVIOUS_RESPONSE_HEADER), body_value, prefix="resp_",
                        param="previous_response_id")


def _from_header(value: str | None, body_value: str | None, *, prefix: str, param: str) -> str | None:
    if value is None or not value.startswith(prefix):
        return body_value
    value = value.strip()
    if body_value is not None and body_value != value:
        raise InvalidRequestError(f"{param} {body_value!r} and the header's {value!r} differ: send one", param=param)
    return value


def affinity_headers(request_headers: Mapping[str, str], session_key: str | None) -> dict[str, str]:
    """The response's affinity headers: the key the client sent, else ours; the token echoed."""
    out = {}
    sent = request_headers.get(SESSION_HEADER)
    key = sent if sent and len(sent) <= MAX_HEADER_CHARS else session_key
    if key:
        out[SESSION_HEADER] = key
    token = request_headers.get(TOKEN_HEADER)
    if token and len(token) <= MAX_HEADER_CHARS:
        out[TOKEN_HEADER] = token
    return out


def chain_key(parent: Any, response_id: str) -> str:
    """A Responses chain's affinity key: its first response's id, carried from parent to child."""
    if parent is None:
        return response_id
    return getattr(parent, "session_key", None) or parent.id


def served_elsewhere(replica_id: str | None, here: str, has_kv: bool) -> bool:
    """Whether a continuation whose KV another replica holds is running here (it re-prefills)."""
    return has_kv and replica_id is not None and replica_id != here
