"""Makes `e2e_helpers` importable by the e2e tests (tests/ is not a package), and runs them on the engine-core
process: the e2e suite's shared server is an app whose engine is another process, reached over ZeroMQ, as in
`loraplex serve`."""

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def api_server(start_server: Any, engine_core: Any) -> Iterator[Any]:
    with start_server(engine_core_address=engine_core.address) as server:
        yield server
