"""The e2e tests run on the engine-core process: the e2e suite's shared server is an app whose engine is another
process, reached over ZeroMQ, as in `loraplex serve`."""

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def api_server(start_server: Any, engine_core: Any) -> Iterator[Any]:
    with start_server(engine_core_address=engine_core.address) as server:
        yield server
