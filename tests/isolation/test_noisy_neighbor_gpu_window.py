"""The GPU noisy-neighbour benchmark's steady window: the engine's rate while the flood can fill every running
slot, so a flood of 256 streams is judged over its first three waves, not only until its first stream ends."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "steady_window", Path(__file__).resolve().parents[2] / "benchmarks" / "steady_window.py")
_window = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_window)
engine_full_until, steady_tokens_per_s = _window.engine_full_until, _window.steady_tokens_per_s


def test_a_flood_no_larger_than_the_slots_is_steady_until_its_first_stream_ends():
    ends = [10.0, 10.5, 11.0]
    assert engine_full_until(ends, max_num_seqs=64) == 10.0
    assert engine_full_until([5.0] * 64, max_num_seqs=64) == 5.0


def test_a_larger_flood_is_steady_until_fewer_streams_than_slots_are_left():
    ends = [float(i) for i in range(256)]
    # after the 193rd end, 63 streams are left for 64 slots
    assert engine_full_until(ends, max_num_seqs=64) == 192.0


def test_the_rate_is_taken_between_samples_inside_the_window():
    samples = [(0.0, 0.0), (1.0, 100.0), (2.0, 300.0), (3.0, 600.0), (4.0, 700.0)]
    assert steady_tokens_per_s(samples, window_end=3.5) == 200.0
    assert steady_tokens_per_s(samples, window_end=0.2) is None  # too short a window to judge
