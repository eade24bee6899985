"""On a GPU, how batch work (the Batch API's lines) shares steps with interactive work while some runs or waits.

Batch work runs beside interactive requests there (a decode step's extra rows
cost little), preempted first, with three limits, each a setting:

- `rows`: at most this many batch rows a step (0: no limit), the lines
  furthest along, so slots free soonest; the others sit the step out.
- `wave`: lines are admitted only once this share of the batch's room is
  free, so few steps carry batch prompts; with a prompt cap, a wave stays
  open over steps until its room is filled.
- `prefill_tokens`: at most this many tokens of batch prompts a step (0: the
  step's budget), so no interactive decode waits on a step heavy with them.

Batch work alone runs at full width and budget. The scheduler asks this
object each step; it owns the wave and the step's prompt allowance.
"""

from __future__ import annotations

from loraplex.engine.sequence import Sequence

BACKGROUND = "\x00background"  # the allowance key of batch work, whatever its tenant (never a real tenant id)


class BatchBesideInteractive:
    def __init__(self, rows: int = 0, wave: float = 0.25, prefill_tokens: int = 32) -> None:
        self.rows = rows
        self.wave = wave
        self.prefill_tokens = prefill_tokens
        self._wave_open = False
        self._prefill_left: int | None = None  # this step's batch prompt tokens left; None: no cap

    def begin_step(self, beside_interactive: bool) -> None:
        """A step is being scheduled; `beside_interactive`: interactive work runs or waits (GPU)."""
        self._prefill_left = (self.prefill_tokens or None) if beside_interactive else None
        if not beside_interactive:
            self._wave_open = False

    def rows_allowance(self, running: list[Sequence]) -> dict[str, set[int]]:
        """The batch rows this step may run, under BACKGROUND ({} when not limited). On a GPU a step's rows are
        not free for a small model: on an H200 a 64-row SmolLM2 step with four adapters took ~2.5-3 ms of GPU and
        host work against ~1.2 ms for one row, and every interactive request decoding beside a full batch ran that
        much slower. The batch's other admitted lines sit the step out; new ones come in only as these finish."""
        if not self.rows:
            return {}
        batch = [s for s in running if s.background]
        return {BACKGROUND: {s.seq_id for s in sorted(batch, key=lambda s: (-s.num_output_tokens, s.seq_id))[:self.rows]}}

    def waits_for_a_wave(self, free_slots: int, max_num_seqs: int, allowance: dict[str, set[int]]) -> bool:
        """Whether batch admission waits this step. Admitted one by one as batch lines finish, nearly every step
        carried a batch prefill (an eager step of 64 SmolLM2 rows took ~15 ms on an H200 against ~3 ms for a
        graph; mixed-step graphs still cost more than a decode graph), and the interactive requests decoding
        beside them paid for it. On Llama-3.1-8B's shapes (H200) lines let in as slots freed made 57% of the steps
        beside interactive work admit prompts, waves of an eighth 22%, of a half 11%: the interactive p95 went from
        1.66x quiet at the first two to 1.52-1.53x at the third, the batch's throughput beside it from ~1.0 to ~0.9.
        That admitting step carried a whole wave's prompts (512 tokens: 14.5 ms of GPU against 5.6 ms for the 64
        decode rows alone); with them capped at 64 tokens a step (6.1 ms) and the wave open until its room is
        filled, waves of a quarter gave 1.52-1.54x at 1.01-1.03x."""
        room, limit = free_slots, max_num_seqs
        if BACKGROUND in allowance:
            limit = self.rows
            room = min(free_slots, limit - len(allowance[BACKGROUND]))
        threshold = max(1, int(limit * self.wave))
        if not self.prefill_tokens:
            return room < threshold
        if room <= 0:
            self._wave_open = False
        elif room >= threshold:
            self._wave_open = True
        return not self._wave_open

    def step_rows(self) -> int:
        """The rows a narrowed step runs for batch work (its room in admission)."""
        return self.rows

    def prefill_chunk(self, num_tokens: int) -> int:
        """How many of `num_tokens` batch prompt tokens this step may still run (all where there is no cap)."""
        left = self._prefill_left
        return num_tokens if left is None else min(num_tokens, left)

    def take_prefill(self, num_tokens: int) -> None:
        if self._prefill_left is not None:
            self._prefill_left -= num_tokens
