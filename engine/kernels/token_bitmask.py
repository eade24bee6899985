"""Apply xgrammar-packed token bitmasks to a batch of logits, in place.

Layout (xgrammar's): ``bitmask[row, i]`` is an int32 whose bit ``j`` allows token ``32 * i + j``.
Bitmask row ``r`` belongs to logits row ``r``; ``indices`` names the rows that have a grammar
(other rows are left untouched), as in ``xgrammar.apply_token_bitmask_inplace``. Negative
indices are skipped, so a CUDA-graph runner can pad ``indices`` to a fixed length with -1.

Unlike xgrammar's op, logits columns past ``32 * bitmask.shape[1]`` are masked too: they are
padded vocabulary ids no grammar can produce, and leaving them open would let a constrained
request sample them.

The Triton kernel reads logits only in words that mix allowed and disallowed tokens and writes
only words that are not fully allowed; its grid depends only on tensor shapes, so it can be
captured in a CUDA graph.
"""

import torch
import triton
import triton.language as tl

BITS_PER_WORD = 32


def _row_indices(indices: torch.Tensor | list[int] | None, device: torch.device) -> torch.Tensor | None:
    if indices is None or isinstance(indices, torch.Tensor):
        return indices
    return torch.tensor(indices, dtype=torch.int32, device=device)


def apply_token_bitmask_reference(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    indices: torch.Tensor | list[int] | None = None,
) -> None:
    """PyTorch reference: unpack the bits, then ``masked_fill_`` the rows that have a grammar."""
    num_words = bitmask.shape[1]
    vocab_size = logits.shape[1]
    shifts = torch.arange(BITS_PER_WORD, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], num_words * BITS_PER_WORD)
    if allowed.shape[1] >= vocab_size:
        allowed = allowed[:, :vocab_size]
    else:
        padding = torch.zeros(allowed.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=allowed.device)
        allowed = torch.cat([allowed, padding], dim=1)
    rows = _row_indices(indices, logits.device)
    if rows is None:
        logits.masked_fill_(~allowed[: logits.shape[0]], float("-inf"))
        return
    rows = rows[rows >= 0].long()
    logits[rows] = logits[rows].masked_fill(~allowed[rows], float("-inf"))


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    indices_ptr,
    vocab_size,
    num_words,
    logits_row_stride,
    bitmask_row_stride,
    HAS_INDICES: tl.constexpr,
    WORDS_PER_PROGRAM: tl.constexpr,
    WHOLE_WORDS: tl.constexpr,
):
    slot = tl.program_id(0)
    row = slot
    if HAS_INDICES:
        row = tl.load(indices_ptr + slot)
    if row >= 0:
        word_ids = tl.program_id(1) * WORDS_PER_PROGRAM + tl.arange(0, WORDS_PER_PROGRAM)
        # Words past the bitmask read as 0: padded vocabulary ids are disallowed.
        words = tl.load(bitmask_ptr + row.to(tl.int64) * bitmask_row_stride + word_ids, mask=word_ids < num_words, other=0)
        bits = tl.arange(0, 32)
        disallowed = ((words[:, None] >> bits[None, :]) & 1) == 0
        token_ids = word_ids[:, None] * 32 + bits[None, :]
        # 2-D [word, bit] tiles keep each word's 32 tokens contiguous without a reshape.
        pointers = logits_ptr + row.to(tl.int64) * logits_row_stride + token_ids
        in_vocab = token_ids < vocab_size
        if WHOLE_WORDS:
            # Masks constant across a word let loads and stores vectorise: read only words with
            # both allowed and disallowed bits, write every word that is not fully allowed.
            mixed = (words != 0) & (words != -1)
            kept = tl.load(pointers, mask=mixed[:, None] & in_vocab, other=float("-inf"))
            tl.store(pointers, tl.where(disallowed, float("-inf"), kept), mask=(words != -1)[:, None] & in_vocab)
        else:
            tl.store(pointers, float("-inf"), mask=disallowed & in_vocab)


def _words_per_program(num_rows: int, vocab_size: int) -> int:
    # Aim for enough programs to cover the SMs at batch 1 without tiny programs at large batch.
    total_words = triton.cdiv(vocab_size, BITS_PER_WORD)
    words = 32 if num_rows <= 4 else 128
    return min(words, triton.next_power_of_2(total_words))


def apply_token_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    indices: torch.Tensor | list[int] | None = None,
    *,
    whole_words: bool = True,
) -> None:
    """Set logits of tokens the bitmask disallows to -inf, in place, on the rows in ``indices``.

    logits: [B, V] float (contiguous rows); bitmask: [B', ceil(V/32)] int32 with B' >= every
    masked row; indices: int tensor on the logits' device of rows to mask (-1 entries skipped),
    a list (copied to the device, so not inside a CUDA-graph capture), or None for all rows. ``whole_words`` picks the vectorised read-where-write variant over per-token
    masked stores (a tuning knob; both compute the same).
    """
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("apply_token_bitmask needs logits and bitmask with contiguous rows")
    rows = _row_indices(indices, logits.device)
    num_rows = logits.shape[0] if rows is None else rows.shape[0]
    vocab_size = logits.shape[1]
    if num_rows == 0 or vocab_size == 0:
        return
    words_per_program = _words_per_program(num_rows, vocab_size)
    grid = (num_rows, triton.cdiv(triton.cdiv(vocab_size, BITS_PER_WORD), words_per_program))
    _apply_token_bitmask_kernel[grid](
        logits,
        bitmask,
        rows if rows is not None else bitmask,
        vocab_size,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        HAS_INDICES=rows is not None,
        WORDS_PER_PROGRAM=words_per_program,
        WHOLE_WORDS=whole_words,
        num_warps=4,
    )
