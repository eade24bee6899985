"""The GPU time of each step's forward pass, by how it ran and its padded rows.

A step's wall time mixes the device's work with the host's (scheduling,
inputs, sampling), and under overlapped scheduling the two run at once, so
the engine's step counters alone cannot say what a step of a given shape
costs the GPU. Here a pair of CUDA events brackets each forward pass on the
stream (a few microseconds of host time a step); their elapsed time is read
once the end event has completed, never by waiting for it. Operators see it
as `loraplex_engine_step_gpu_seconds_total{kind,rows}`: what a mixed step
admitting prompts costs beside a decode step of the same batch is what
prices batch work running beside interactive traffic.
"""

from __future__ import annotations

from collections import deque

import torch

MAX_OPEN = 4096  # pairs not yet read; past it the oldest are dropped unread (a stats reader that never comes)


class StepTimer:
    def __init__(self) -> None:
        self.totals: dict[tuple[str, int], list[float]] = {}  # (kind, padded rows) -> [steps, GPU seconds]
        self._open: deque[tuple[torch.cuda.Event, torch.cuda.Event, tuple[str, int]]] = deque()
        self._spare: list[torch.cuda.Event] = []
        # The engine's stream, looked up once: `Event.record()` without one looks up the current stream each
        # time (~5 us of Python), twice a step. Forward passes start and end on the thread's current stream.
        self._stream: torch.cuda.Stream | None = None

    def begin(self) -> torch.cuda.Event:
        """Record the start of a forward pass on the current stream."""
        self._read_finished()
        if self._stream is None:
            self._stream = torch.cuda.current_stream()
        start = self._event()
        start.record(self._stream)
        return start

    def end(self, start: torch.cuda.Event, kind: str, rows: int) -> None:
        """Record its end; `kind` (decode_graph, mixed_graph, eager) and `rows` (the padded rows) key it."""
        stop = self._event()
        stop.record(self._stream)
        if len(self._open) >= MAX_OPEN:
            old_start, old_stop, _ = self._open.popleft()
            self._spare += [old_start, old_stop]
        self._open.append((start, stop, (kind, rows)))

    def snapshot(self) -> dict[str, list[float]]:
        """`kind:rows` -> [steps, GPU seconds] of every forward pass finished so far."""
        self._read_finished()
        return {f"{kind}:{rows}": list(total) for (kind, rows), total in sorted(self.totals.items())}

    def _read_finished(self) -> None:
        while self._open and self._open[0][1].query():
            start, stop, key = self._open.popleft()
            total = self.totals.setdefault(key, [0, 0.0])
            total[0] += 1
            total[1] += start.elapsed_time(stop) / 1000.0
            self._spare += [start, stop]

    def _event(self) -> torch.cuda.Event:
        return self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
