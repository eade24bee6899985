"""One real server per test module (the shared engine; in-process or Redis response store)."""

from __future__ import annotations

import pytest

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16  # the engine's KV block: pinned KV covers whole blocks only


@pytest.fixture(scope="module")
def server(start_server):
    with start_server() as running:
        yield running


@pytest.fixture(scope="module")
def redis_server(start_server, redis_url, redis_prefix):
    with start_server(redis_url=redis_url, redis_key_prefix=f"{redis_prefix}resp:") as running:
        yield running
