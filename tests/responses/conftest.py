"""One real server per test module (on the shared engine)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def server(start_server):
    with start_server() as running:
        yield running

