"""/metrics counts the engine's steps by how they ran (`loraplex_engine_steps_total{kind}`: decode graph, mixed-step
graph, eager on CUDA), and shows nothing of it where the engine reports no kinds (the CPU)."""

from __future__ import annotations

from engine_metrics_scrape import scrape


def test_steps_are_counted_by_kind() -> None:
    family = scrape({"engine_steps": {"decode_graph": 120, "mixed_graph": 7, "eager": 1}})["loraplex_engine_steps"]
    assert family.type == "counter"
    samples = {s.labels["kind"]: s.value for s in family.samples if s.name == "loraplex_engine_steps_total"}
    assert samples == {"decode_graph": 120.0, "mixed_graph": 7.0, "eager": 1.0}
    assert all(s.labels["model_name"] == "smol" for s in family.samples)


def test_no_step_counter_without_kinds() -> None:
    assert "loraplex_engine_steps" not in scrape({"engine_steps": {}})
    assert "loraplex_engine_steps" not in scrape({})
