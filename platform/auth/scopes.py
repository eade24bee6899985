"""What an API key may do."""

from __future__ import annotations

from enum import StrEnum


class Scope(StrEnum):
    INFERENCE = "inference"  # /v1/chat/completions, /v1/completions, /v1/models
    ADAPTERS = "adapters"    # upload, list, delete the tenant's adapters
    USAGE = "usage"          # read the tenant's usage reports
    ADMIN = "admin"          # manage tenants and keys (platform operators)


ALL_SCOPES = frozenset(Scope)


def parse_scopes(values: list[str] | str) -> list[Scope]:
    """Validate scope names (comma or space separated); raises ValueError naming the bad one."""
    if isinstance(values, str):
        values = values.replace(",", " ").split()
    scopes: list[Scope] = []
    for value in values:
        if not isinstance(value, str):
            raise ValueError(f"scopes must be names (strings), not {type(value).__name__}")
        try:
            scope = Scope(value.strip())
        except ValueError:
            raise ValueError(f"unknown scope {value!r}; choose from {', '.join(s.value for s in Scope)}") from None
        if scope not in scopes:
            scopes.append(scope)
    if not scopes:
        raise ValueError("at least one scope is required")
    return scopes
