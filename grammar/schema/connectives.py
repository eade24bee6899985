"""Building `allOf`/`anyOf` out of rewritten parts, simplified as they are built (true and false absorbed)."""

from __future__ import annotations

from typing import Any


def conjoin(node: dict, extra: Any) -> Any:
    """`node` and `extra` both hold."""
    if extra is False:
        return False
    if extra is True or extra == {}:
        return node
    node = dict(node)
    if isinstance(extra, dict) and set(extra) == {"anyOf"} and "anyOf" not in node:
        node["anyOf"] = extra["anyOf"]  # the same conjunction; backends merge a sibling anyOf more readily
    else:
        node["allOf"] = [*node.get("allOf", []), extra]
    return node


def all_of(members: list[Any]) -> Any:
    if any(m is False for m in members):
        return False
    kept = [m for m in members if m is not True and m != {}]
    if not kept:
        return True
    return kept[0] if len(kept) == 1 else {"allOf": kept}


def any_of(members: list[Any]) -> Any:
    if any(m is True or m == {} for m in members):
        return True
    kept = [m for m in members if m is not False]
    if not kept:
        return False
    return kept[0] if len(kept) == 1 else {"anyOf": kept}
