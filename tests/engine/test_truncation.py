"""Top-k and top-p keep exactly the tokens a full sort of the row keeps, whichever way they get there."""

from __future__ import annotations

import time

import pytest
import torch
from loraplex.engine.truncation import mask_top_k, mask_top_p

VOCAB = 49152


def _sorted_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """The reference: each row sorted whole."""
    out = logits.clone()
    for i, k in enumerate(top_ks):
        if 0 < k < logits.shape[-1]:
            kth = logits[i].sort(descending=True).values[k - 1]
            out[i] = logits[i].masked_fill(logits[i] < kth, float("-inf"))
    return out


def _nucleus_boundary(logits: torch.Tensor, top_ps: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference, each row sorted whole in float64: which tokens it keeps, and which lie so near the boundary
    (the mass above them within 1e-4 of top_p) that float32 rounding may put them either side."""
    kept = torch.ones_like(logits, dtype=torch.bool)
    near = torch.zeros_like(logits, dtype=torch.bool)
    for i, p in enumerate(top_ps):
        if p < 1.0:
            values, order = logits[i].double().sort(descending=True)
            probs = values.softmax(-1)
            before = probs.cumsum(-1) - probs
            kept[i] = torch.zeros_like(before, dtype=torch.bool).scatter_(0, order, before < p)
            near[i] = torch.zeros_like(before, dtype=torch.bool).scatter_(0, order, (before - p).abs() < 1e-4)
    return kept, near


def _sorted_top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """What sorting every row whole in float32 costs (the way the host used to do it)."""
    out = logits.clone()
    for i, p in enumerate(top_ps):
        values, order = logits[i].sort(descending=True)
        probs = values.softmax(-1)
        before = probs.cumsum(-1) - probs
        drop = torch.zeros_like(before, dtype=torch.bool).scatter_(0, order, before >= p)
        out[i] = logits[i].masked_fill(drop, float("-inf"))
    return out


def _rows(seed: int) -> torch.Tensor:
    """Peaked rows (a trained model's), flat ones (the nucleus spans thousands of tokens), masked ones (a grammar
    leaves a few tokens), and one with a single token allowed."""
    generator = torch.Generator().manual_seed(seed)
    peaked = torch.randn(4, VOCAB, generator=generator) * 4
    flat = torch.randn(3, VOCAB, generator=generator) * 0.05
    masked = torch.randn(2, VOCAB, generator=generator).masked_fill(torch.rand(2, VOCAB, generator=generator) > 0.001,
                                                                    float("-inf"))
    single = torch.full((1, VOCAB), float("-inf"))
    single[0, 7] = 0.0
    return torch.cat([peaked, flat, masked, single])


@pytest.mark.parametrize("seed", [0, 1])
def test_top_p_keeps_what_a_full_sort_keeps(seed):
    logits = _rows(seed)
    top_ps = [0.9, 0.5, 1.0, 0.99, 0.9, 0.3, 1.0, 0.95, 0.2, 0.7]
    kept = torch.isfinite(mask_top_p(logits, top_ps))
    expected, near = _nucleus_boundary(logits, top_ps)
    expected &= torch.isfinite(logits)
    assert torch.equal(kept & ~near, expected & ~near)
    assert kept[1].sum() < 100 < kept[4].sum()  # peaked rows settle among the candidates, flat ones need the sort
    assert kept[2].all() and kept[6].sum() == torch.isfinite(logits[6]).sum()  # no top-p: the whole row


@pytest.mark.parametrize("seed", [0, 1])
def test_top_k_keeps_what_a_full_sort_keeps(seed):
    logits = _rows(seed)
    top_ks = [1, 50, 0, 2**63 - 1, 1000, 40, VOCAB, 3, 20, 5]
    assert torch.equal(mask_top_k(logits, top_ks), _sorted_top_k(logits, top_ks))


def test_top_p_on_host_rows_costs_a_fraction_of_sorting_them():
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    top_ps = [0.9] * 16

    def best_of(run) -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return min(times)

    fast = best_of(lambda: mask_top_p(logits, top_ps))
    sorted_whole = best_of(lambda: _sorted_top_p(logits, top_ps))
    assert fast < 0.5 * sorted_whole, (fast, sorted_whole)
