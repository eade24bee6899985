"""The architecture page's sketch of the processes `loraplex serve` runs names the real parts."""

from __future__ import annotations

from readme_examples import Example, readme_example


@readme_example("process-layout")
def test_process_layout_sketch_names_real_parts(example: Example, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import os

    from loraplex.engine.core.engine_core import EngineCore
    from loraplex.platform.settings import Settings
    from loraplex.platform.supervisor import Supervisor, run_api_server

    for part in ("supervisor", "engine core", "API server × N", "LORAPLEX_API_SERVERS, default 1; with Redis up to 8"):
        assert part in example.text
    assert Settings().api_servers == 1  # without Redis
    # With Redis: half the cores this process may run on, at least 1 and at most 8
    for cores, expected in ((1, 1), (2, 1), (6, 3), (16, 8), (64, 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert Settings(redis_url="redis://localhost:6379/0").api_servers == expected
    assert Settings(redis_url="redis://localhost:6379/0", api_servers=7).api_servers == 7  # as configured
    assert callable(run_api_server) and Supervisor.run and EngineCore.run
