"""A hand-written CompiledGrammar for tests: step i allows exactly the tokens in `allowed[i]`."""

from __future__ import annotations

import numpy as np
import torch


class FixedSetMatcher:
    def __init__(self, allowed: list[list[int]]) -> None:
        self.allowed = allowed
        self.position = 0

    def accept_token(self, token_id: int) -> bool:
        ok = self.position < len(self.allowed) and token_id in self.allowed[self.position]
        self.position += 1
        return ok

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = np.zeros(bitmask.shape[1], dtype=np.int64)
        for token in self.allowed[self.position]:
            words[token // 32] |= 1 << (token % 32)
        bitmask[row] = torch.from_numpy(words.astype(np.uint32).view(np.int32))

    def is_terminated(self) -> bool:
        return self.position >= len(self.allowed)


class FixedSetGrammar:
    def __init__(self, allowed: list[list[int]]) -> None:
        self.allowed = allowed

    def new_matcher(self) -> FixedSetMatcher:
        return FixedSetMatcher(self.allowed)
