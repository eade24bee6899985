"""Reading a grammar's packed token bitmask in tests: which token ids a row allows.

A plain module rather than conftest.py, so both tests/grammar and tests/engine import it. Unpacked with tensor
ops: a Python loop over the 49,152 ids of SmolLM2's vocabulary costs ~50 ms a mask, and the walks that read a
mask per token spent most of their time there.
"""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int64)


def allowed_token_ids(words: torch.Tensor, vocab_size: int) -> list[int]:
    """The ids below `vocab_size` whose bit is set in one row of 32-bit words (bit i of word w is id 32 * w + i)."""
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    bits = (unsigned.unsqueeze(-1) >> _BITS) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()
