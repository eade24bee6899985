"""/metrics counts the engine's steps by how they ran (`loraplex_engine_steps_total{kind}`: decode graph, mixed-step
graph, eager on CUDA; `loraplex_engine_overlap_steps_total{outcome}` under overlapped scheduling; the GPU time of
the forward passes by kind and padded rows), and shows nothing of it where the engine reports no kinds (the CPU)."""

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
    assert "loraplex_engine_overlap_steps" not in scrape({"overlap_steps": {}})


def test_overlap_outcomes_are_counted() -> None:
    """With overlapped scheduling on, each step by whether the host ran ahead of the device or why it waited."""
    outcomes = {"ahead": 900, "launched": 40, "not_plain": 12, "room": 0, "drafts": 3, "not_launchable": 45,
                "launch_failed": 0}
    family = scrape({"overlap_steps": outcomes})["loraplex_engine_overlap_steps"]
    assert family.type == "counter"
    samples = {s.labels["outcome"]: s.value for s in family.samples if s.name == "loraplex_engine_overlap_steps_total"}
    assert samples == {k: float(v) for k, v in outcomes.items()}


def test_step_gpu_time_by_kind_and_rows() -> None:
    """CUDA: each forward pass's GPU time, summed by how the step ran and its padded rows, with the steps timed."""
    scraped = scrape({"engine_step_gpu": {"decode_graph:64": [100, 0.5], "mixed_graph:576": [4, 0.06]}})
    seconds = {(s.labels["kind"], s.labels["rows"]): s.value for s in scraped["loraplex_engine_step_gpu_seconds"].samples
               if s.name == "loraplex_engine_step_gpu_seconds_total"}
    steps = {(s.labels["kind"], s.labels["rows"]): s.value for s in scraped["loraplex_engine_timed_steps"].samples
             if s.name == "loraplex_engine_timed_steps_total"}
    assert seconds == {("decode_graph", "64"): 0.5, ("mixed_graph", "576"): 0.06}
    assert steps == {("decode_graph", "64"): 100.0, ("mixed_graph", "576"): 4.0}
    assert "loraplex_engine_step_gpu_seconds" not in scrape({"engine_step_gpu": {}})
