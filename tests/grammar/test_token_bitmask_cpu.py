"""The CPU bitmask apply of the sampler: bit for bit what unpacking the whole vocabulary and `masked_fill_` gave."""

from __future__ import annotations

import pytest
import torch
from loraplex.engine.sampler import apply_token_bitmask

_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpacked_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The sampler's previous implementation, kept here as the reference."""
    vocab = logits.shape[-1]
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS) & 1
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))


def random_bitmask(gen: torch.Generator, rows: int, words: int) -> torch.Tensor:
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    kinds = torch.randint(0, 4, (rows,), generator=gen)
    for r in range(rows):
        if kinds[r] == 0:
            bitmask[r] = -1                  # a row with no mask: everything allowed
        elif kinds[r] == 1:
            bitmask[r] = 0                   # nothing allowed
        elif kinds[r] == 2:                  # a structural mask: few mixed words, the rest all-0 or all-1
            bitmask[r] = torch.where(torch.rand(words, generator=gen) < 0.5, 0, -1).to(torch.int32)
            bitmask[r, torch.randint(0, words, (3,), generator=gen)] = torch.randint(
                -2**31, 2**31 - 1, (3,), dtype=torch.int32, generator=gen)
    bitmask[:, -1] |= -2**31                 # the top bit (the sign) set somewhere too
    return bitmask


def random_logits(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=gen) * 10
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 1e-45])
    where = torch.randint(0, rows * vocab, (min(64, rows * vocab),), generator=gen)
    logits.view(-1)[where] = specials[torch.arange(len(where)) % len(specials)]
    return logits


@pytest.mark.parametrize("vocab", [49152, 49155 - 32, 1, 31, 33, 100, 4096])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_equal_to_the_unpacked_reference_bit_for_bit(vocab, rows):
    gen = torch.Generator().manual_seed(vocab * 31 + rows)
    for _ in range(3):
        bitmask = random_bitmask(gen, rows, (vocab + 31) // 32)
        logits = random_logits(gen, rows, vocab)
        expected, got = logits.clone(), logits.clone()
        unpacked_reference(expected, bitmask)
        apply_token_bitmask(got, bitmask)
        assert torch.equal(expected.view(torch.int32), got.view(torch.int32))


def test_rows_of_a_wider_tensor_and_other_dtypes():
    gen = torch.Generator().manual_seed(3)
    bitmask = random_bitmask(gen, 4, 4)
    wide = random_logits(gen, 4, 200)
    expected, got = wide.clone(), wide.clone()
    unpacked_reference(expected[:, :100], bitmask)
    apply_token_bitmask(got[:, :100], bitmask)   # a strided view: written through, the rest untouched
    assert torch.equal(expected.view(torch.int32), got.view(torch.int32))
    doubles = wide[:, :100].double()
    expected64, got64 = doubles.clone(), doubles.clone()
    unpacked_reference(expected64, bitmask)
    apply_token_bitmask(got64, bitmask)
    assert torch.equal(expected64.view(torch.int64), got64.view(torch.int64))
