"""One input-batch builder for every runner: a scheduled step -> integer arrays.

The CPU runner, the CUDA runner (eager and graph replay) and every tensor-parallel worker
consume the same `InputBatch`: token ids, positions, cache slots, per-sequence query and
context lengths, block tables, the rows whose logits are wanted and the LoRA slot of each
token. It is plain numpy (int32), built with vectorised index arithmetic, and small enough to
send to the worker processes each step; each runner then turns it into its own attention
metadata.

Row order: every one-token query (decodes, by context length so the CPU path's length
buckets are contiguous) first, then each prefill chunk. A decode-only batch can be padded
to a CUDA graph's size: padding rows write no K/V (slot -1) and attend to nothing (length 0).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
from loraplex.engine.scheduler import SchedulerOutput
from loraplex.engine.sequence import Sequence


@dataclass(slots=True)
class StepRows:
    """A scheduled step split into the batch's row groups (host objects, never sent)."""

    decodes: list[Sequence]
    prefills: list[tuple[Sequence, int]]
    forks: list[Sequence]        # sample their parent's last row; no tokens of their own
    sampled: list[Sequence]      # rows that end at the sequence's last token, in row order
    # Decodes with draft tokens (engine/spec): among `prefills`, one row per token (the last real one, then
    # the drafts), every row's logits wanted; verified on the host, never in `sampled`
    verified: list[tuple[Sequence, int]] = field(default_factory=list)

    @classmethod
    def of(cls, step: SchedulerOutput) -> StepRows:
        pairs = list(zip(step.seqs, step.num_new_tokens, strict=True))
        decodes = sorted((s for s, n in pairs if n == 1), key=lambda s: s.num_computed_tokens)
        prefills = [(s, n) for s, n in pairs if n > 1]
        forks = [s for s, n in pairs if n == 0]
        ordered = [(s, 1) for s in decodes] + prefills
        sampled = [s for s, n in ordered if s.num_computed_tokens + n == len(s.token_ids)]
        verified = [(s, n) for s, n in prefills if s.spec_token_ids]
        return cls(decodes, prefills, forks, sampled, verified)

    @property
    def ordered(self) -> list[tuple[Sequence, int]]:
        return [(s, 1) for s in self.decodes] + self.prefills

    @property
    def is_plain_decode(self) -> bool:
        """Decodes only, each sampled, none wanting prompt logprobs: what a decode graph replays."""
        return (bool(self.decodes) and not self.prefills and not self.forks
                and len(self.sampled) == len(self.decodes)
                and not any(s.wants_prompt_logprobs for s in self.decodes))


@dataclass(slots=True)
class InputBatch:
    num_decodes: int                 # rows [0, num_decodes) hold one new token each
    num_seqs: int                    # live rows; rows past it are graph padding
    input_ids: np.ndarray            # [T] int32
    positions: np.ndarray            # [T]
    slot_mapping: np.ndarray         # [T] flat cache slot of each new token, -1 for padding
    query_lens: np.ndarray           # [S]
    seq_lens: np.ndarray             # [S] tokens of context after this step (0 for padding)
    block_tables: np.ndarray         # [S, W], 0 past a sequence's blocks
    logit_rows: np.ndarray           # [n] rows whose logits are sampled (forks: their parent's row)
    # Rows [start, end) whose logits score prompt tokens (prompt logprobs), one span per sequence
    prompt_logprob_spans: list[tuple[int, int]] = field(default_factory=list)
    lora_slots: np.ndarray | None = None  # [T] adapter slot per token (-1: base); None: no adapter
    use_graph: bool = False          # replay the decode graph of this padded size

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.size)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == self.num_seqs

    @property
    def cu_seqlens_q(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.query_lens)]).astype(np.int32)

    @property
    def last_rows(self) -> np.ndarray:
        """Each live sequence's last row."""
        return np.cumsum(self.query_lens[: self.num_seqs]) - 1


def build_input_batch(rows: StepRows, block_size: int, *, table_width: int | None = None,
                      pad_to: int | None = None) -> InputBatch:
    """`table_width`: block-table columns (default: the step's longest); `pad_to`: rows of a
    decode-only batch padded to a graph size."""
    ordered = rows.ordered
    count = len(ordered)
    size = max(count, pad_to or 0)
    if size > count and rows.prefills:
        raise ValueError("only a decode-only batch is padded")
    starts = np.fromiter((s.num_computed_tokens for s, _ in ordered), dtype=np.int64, count=count)
    query_lens = np.fromiter((n for _, n in ordered), dtype=np.int64, count=count)
    seq_lens = starts + query_lens
    num_tokens = int(query_lens.sum())
    cu = np.concatenate([[0], np.cumsum(query_lens)])
    ids = np.zeros(num_tokens + size - count, dtype=np.int32)
    ids[: len(rows.decodes)] = [s.token_ids[s.num_computed_tokens] for s in rows.decodes]
    for (seq, n), row in zip(rows.prefills, cu[len(rows.decodes) : -1], strict=True):
        start = seq.num_computed_tokens
        chunk = seq.token_ids[start : start + n]
        if len(chunk) < n:  # a decode verifying drafts: its last token, then the drafts
            chunk = chunk + seq.spec_token_ids[: n - len(chunk)]
        ids[row : row + n] = chunk
    token_rows = np.repeat(np.arange(count), query_lens)
    positions = np.zeros(ids.size, dtype=np.int64)
    positions[:num_tokens] = np.arange(num_tokens) - cu[token_rows] + starts[token_rows]
    need = -(-seq_lens // block_size)
    width = table_width or max(int(need.max()) if count else 1, 1)
    tables = _block_tables([s.block_table for s, _ in ordered], np.minimum(need, width), size, width)
    slots = np.full(ids.size, -1, dtype=np.int64)
    live = positions[:num_tokens]
    slots[:num_tokens] = tables[token_rows, live // block_size].astype(np.int64) * block_size + live % block_size
    last = cu[1:] - 1
    row_of = {s.seq_id: int(r) for (s, _), r in zip(ordered, last, strict=True)}
    logit_rows = [row_of[s.seq_id] for s in rows.sampled] + [row_of[_parent(s).seq_id] for s in rows.forks]
    for seq, n in rows.verified:  # after the sampled rows: engine/spec/verify.py splits them off
        logit_rows.extend(range(row_of[seq.seq_id] + 1 - n, row_of[seq.seq_id] + 1))
    query_len_of = {s.seq_id: n for s, n in ordered}
    spans = []
    for seq, start, end in prompt_logprob_seqs(rows):
        first = row_of[seq.seq_id] + 1 - query_len_of[seq.seq_id]
        spans.append((first, first + end - start))
    padded = np.zeros(size, dtype=np.int32)
    return InputBatch(
        num_decodes=len(rows.decodes), num_seqs=count, input_ids=ids,
        positions=positions.astype(np.int32), slot_mapping=slots.astype(np.int32),
        query_lens=_padded(query_lens, padded), seq_lens=_padded(seq_lens, padded), block_tables=tables,
        logit_rows=np.asarray(logit_rows, dtype=np.int32), prompt_logprob_spans=spans,
    )


def prompt_logprob_seqs(rows: StepRows) -> list[tuple[Sequence, int, int]]:
    """(sequence, first, end) prompt positions scored this step, in row order; position p's
    logits score prompt token p + 1 (the last prompt row predicts output, so it is left out)."""
    out = []
    for seq, n in rows.ordered:
        if not seq.wants_prompt_logprobs:
            continue
        start = seq.num_computed_tokens
        end = min(start + n, seq.num_prompt_tokens - 1)
        if end > start:
            out.append((seq, start, end))
    return out


def _padded(values: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    out = zeros.copy()
    out[: values.size] = values
    return out


def _block_tables(block_tables: list[list[int]], lengths: np.ndarray, size: int, width: int) -> np.ndarray:
    """Rows of block ids, vectorised: at batch 512 a per-row loop costs milliseconds a step."""
    count = len(block_tables)
    flat = np.fromiter(itertools.chain.from_iterable(t[:n] for t, n in zip(block_tables, lengths.tolist(),
                                                                               strict=True)),
                       dtype=np.int32, count=int(lengths.sum()))
    rows = np.repeat(np.arange(count), lengths)
    columns = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    tables = np.zeros((size, width), dtype=np.int32)
    tables[rows, columns] = flat
    return tables


def _parent(fork: Sequence) -> Sequence:
    if fork.parent is None:  # the scheduler forks only children whose parent is still prefilling
        raise ValueError(f"sequence {fork.seq_id} is scheduled as a fork but has no parent")
    return fork.parent
