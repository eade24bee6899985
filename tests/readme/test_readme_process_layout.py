"""README's sketch of the processes `loraplex serve` runs names the real parts."""

from __future__ import annotations

from readme_examples import Example, readme_example


@readme_example("process-layout")
def test_process_layout_sketch_names_real_parts(example: Example) -> None:
    from loraplex.engine.core.engine_core import EngineCore
    from loraplex.platform.settings import Settings
    from loraplex.platform.supervisor import Supervisor, run_api_server

    for part in ("supervisor", "engine core", "API server × N", "LORAPLEX_API_SERVERS, default 1; with Redis up to 4"):
        assert part in example.text
    assert Settings().api_servers == 1  # without Redis
    assert 1 <= Settings(redis_url="redis://localhost:6379/0").api_servers <= 4
    assert callable(run_api_server) and Supervisor.run and EngineCore.run
