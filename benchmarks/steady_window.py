"""The window in which a flood's throughput is judged: while the engine is full of its streams.

A flood of equal streams that all start together ramps up, runs with every running slot taken, then tails off as
its streams end. Only the middle says what the engine does with a full batch, with fair sharing or without.
"""

from __future__ import annotations


def engine_full_until(ends: list[float], max_num_seqs: int) -> float:
    """When the flood could no longer fill the engine's running slots: the end after which fewer than
    `max_num_seqs` of its streams were left (the first end for a flood of at most `max_num_seqs` streams)."""
    return ends[max(0, len(ends) - max_num_seqs)]


def steady_tokens_per_s(samples: list[tuple[float, float]], window_end: float) -> float | None:
    """Tokens per second between the first sample and the last one before `window_end` (until then the flood
    has a stream for every running slot: `engine_full_until`)."""
    inside = [s for s in samples if s[0] <= window_end]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < 0.5:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
