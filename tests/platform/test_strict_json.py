"""Request bodies must be Unicode text: a lone surrogate escape is refused wherever it sits, on every API route."""

from __future__ import annotations

import json

import pytest
from fastapi.routing import APIRoute
from loraplex.platform.api.strict_json import StrictJSONRoute, loads_strict


@pytest.mark.parametrize("text", [
    '{"a": "x\\ud800"}', '{"a\\udfff": 1}', '[["deep", {"k": ["\\uDBFF"]}]]', '"\\ud83d"', '"\\ude00\\ud83d"',
])
def test_lone_surrogates_are_refused(text: str) -> None:
    with pytest.raises(json.JSONDecodeError, match="lone UTF-16 surrogate"):
        loads_strict(text.encode())


@pytest.mark.parametrize("text", [
    '{"a": "\\ud83d\\ude00"}', '{"a": "plain"}', '{"a": "\\\\ud800"}', '{"a": "\\u00e9 \\uffff"}', '"é😀"',
])
def test_text_is_parsed_as_json_loads_would(text: str) -> None:
    assert loads_strict(text.encode()) == json.loads(text)


def test_every_api_route_parses_bodies_strictly() -> None:
    from loraplex.platform.portal import build_portal_router
    from loraplex.platform.routers import all_routers

    routes = [route for router in [*all_routers(), build_portal_router()] for route in router.routes
              if isinstance(route, APIRoute)]
    assert len(routes) > 20
    loose = [route.path for route in routes if not isinstance(route, StrictJSONRoute)]
    assert loose == []


@pytest.mark.parametrize(("raw", "reason"), [
    (b'{"a":' * 5000 + b"1" + b"}" * 5000, "nest deeper than the parser allows"),
    (b"[" * 100_000 + b"]" * 100_000, "nest deeper than the parser allows"),
    (b'{"seed": ' + b"1" * 5000 + b"}", "a number is too long to read"),
])
def test_bodies_the_parser_refuses_otherwise_are_malformed_json(raw: bytes, reason: str) -> None:
    """Python's parser raises RecursionError and ValueError for these, which FastAPI would answer with a bare
    "error parsing the body"; as JSONDecodeError they get the usual 400 that names the reason."""
    with pytest.raises(json.JSONDecodeError, match=reason):
        loads_strict(raw)
