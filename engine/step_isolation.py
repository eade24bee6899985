"""One request's failure while a batch steps fails that request alone.

When running a step raises, the step is run again in halves, and a half that
raises is halved again, until the rows that raise are alone: each of those
gets the error (`StepResult.errors`), every other row its normal result. A
fork child stays with its parent (it samples the parent's row), and a
copy-on-write block copy travels with the row that owns its destination.
Running a row twice is safe: its K/V are written again with the same values,
and its random draw for a position is made once (`Sequence.drawn_at`), so
the retried rows produce exactly the tokens a clean step would have.
A poisoned batch of n rows costs about 2·log2(n) extra steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from loraplex.engine.runner import StepResult
from loraplex.engine.scheduler import SchedulerOutput
from loraplex.engine.sequence import Sequence

logger = logging.getLogger(__name__)

Unit = list[tuple[Sequence, int]]  # a row and the fork children that sample it


def execute_isolating(execute: Callable[[SchedulerOutput], StepResult], step: SchedulerOutput) -> StepResult:
    try:
        return execute(step)
    except Exception as exc:
        units = _units(step)
        logger.warning("a step of %d rows failed (%s: %s); finding the rows that cause it", len(step.seqs),
                       type(exc).__name__, exc)
        if len(units) == 1:
            return _failed(units[0], exc)
        result = StepResult()
        half = len(units) // 2
        for part in (units[:half], units[half:]):
            _merge(result, _run(execute, part, step.blocks_to_copy))
        return result


def _run(execute: Callable[[SchedulerOutput], StepResult], units: list[Unit],
         copies: list[tuple[int, int]]) -> StepResult:
    try:
        return execute(_sub_step(units, copies))
    except Exception as exc:
        if len(units) == 1:
            seq = units[0][0][0]
            logger.warning("request %s fails the step alone: %s: %s", seq.request_id, type(exc).__name__, exc)
            return _failed(units[0], exc)
        result = StepResult()
        half = len(units) // 2
        for part in (units[:half], units[half:]):
            _merge(result, _run(execute, part, copies))
        return result


def _units(step: SchedulerOutput) -> list[Unit]:
    units: dict[int, Unit] = {}
    children: list[tuple[Sequence, int]] = []
    for seq, num_new in zip(step.seqs, step.num_new_tokens, strict=True):
        if num_new == 0 and seq.parent is not None:
            children.append((seq, num_new))
        else:
            units[seq.seq_id] = [(seq, num_new)]
    for child, num_new in children:
        parent = child.parent
        units.setdefault(parent.seq_id if parent is not None else child.seq_id, []).append((child, num_new))
    return list(units.values())


def _sub_step(units: list[Unit], copies: list[tuple[int, int]]) -> SchedulerOutput:
    rows = [row for unit in units for row in unit]
    owned = {block for seq, _ in rows for block in seq.block_table}
    return SchedulerOutput([s for s, _ in rows], [n for _, n in rows], [c for c in copies if c[1] in owned])


def _failed(unit: Unit, exc: Exception) -> StepResult:
    result = StepResult()
    for seq, _ in unit:
        result.errors[seq.seq_id] = exc
    return result


def _merge(into: StepResult, part: StepResult) -> None:
    into.sampled.update(part.sampled)
    into.logprobs.update(part.logprobs)
    into.prompt_logprobs.update(part.prompt_logprobs)
    into.errors.update(part.errors)
    into.spec_logits.update(part.spec_logits)
    into.spec_argmax.update(part.spec_argmax)
