"""The Triton bitmask kernel against its PyTorch reference and xgrammar's own CPU op."""

import pytest
import torch
import triton
from loraplex.engine.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_bitmask(num_rows: int, num_words: int, allowed_fraction: float, generator: torch.Generator) -> torch.Tensor:
    bits = torch.rand(num_rows, num_words, 32, generator=generator) < allowed_fraction
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)
    words = (bits.long() * weights).sum(-1)
    # Reinterpret as int32 so bit 31 becomes the sign bit, exactly as xgrammar packs it.
    return words.to(torch.int64).where(words < 2**31, words - 2**32).to(torch.int32)


def random_logits(num_rows: int, vocab_size: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=generator).to(dtype)


def run_both(logits, bitmask, indices, device=DEVICE, whole_words=True):
    ours = logits.clone().to(device)
    mask = bitmask.to(device)
    index = indices if not isinstance(indices, torch.Tensor) else indices.to(device)
    apply_token_bitmask(ours, mask, index, whole_words=whole_words)
    expected = logits.clone()
    apply_token_bitmask_reference(expected, bitmask, indices)
    return ours.cpu(), expected


@pytest.mark.parametrize("whole_words", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_rows", "vocab_size", "num_words"),
    [(1, 32, 1), (3, 1000, 32), (4, 4099, 129), (2, 4000, 130), (5, 257, 8)],
)
def test_kernel_matches_reference(whole_words, dtype, num_rows, vocab_size, num_words):
    generator = torch.Generator().manual_seed(num_rows * 1000 + vocab_size)
    logits = random_logits(num_rows, vocab_size, dtype, generator)
    bitmask = random_bitmask(num_rows, num_words, 0.3, generator)
    # Whole words of each kind, as grammar masks have them: all allowed and all disallowed.
    bitmask[:, 2::5] = -1
    bitmask[:, 3::5] = 0
    ours, expected = run_both(logits, bitmask, None, whole_words=whole_words)
    assert torch.equal(ours, expected)
    assert torch.isinf(ours).any() and torch.isfinite(ours).any()


def test_tokens_past_the_bitmask_are_masked_and_short_vocab_ignores_extra_words():
    generator = torch.Generator().manual_seed(7)
    all_allowed = torch.full((2, 4), -1, dtype=torch.int32)
    logits = random_logits(2, 200, torch.float32, generator)
    ours, _ = run_both(logits, all_allowed, None)
    assert torch.equal(ours[:, :128], logits[:, :128])
    assert torch.isneginf(ours[:, 128:]).all()

    short = random_logits(2, 100, torch.float32, generator)
    ours, _ = run_both(short, all_allowed, None)
    assert torch.equal(ours, short)


@pytest.mark.parametrize("as_tensor", [True, False])
def test_rows_without_grammar_are_untouched(as_tensor):
    generator = torch.Generator().manual_seed(11)
    logits = random_logits(6, 300, torch.float32, generator)
    bitmask = random_bitmask(6, 10, 0.5, generator)
    rows = [4, 1, 2]
    indices = torch.tensor(rows, dtype=torch.int32) if as_tensor else rows
    ours, expected = run_both(logits, bitmask, indices)
    assert torch.equal(ours, expected)
    for row in (0, 3, 5):
        assert torch.equal(ours[row], logits[row])
    for row in rows:
        assert torch.isneginf(ours[row]).any()


def test_negative_indices_pad_a_fixed_length_index_tensor():
    generator = torch.Generator().manual_seed(13)
    logits = random_logits(4, 96, torch.float32, generator)
    bitmask = random_bitmask(4, 3, 0.5, generator)
    padded = torch.tensor([2, -1, 0, -1], dtype=torch.int32)
    ours, expected = run_both(logits, bitmask, padded)
    same, _ = run_both(logits, bitmask, [2, 0])
    assert torch.equal(ours, expected)
    assert torch.equal(ours, same)
    assert torch.equal(ours[1], logits[1]) and torch.equal(ours[3], logits[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("indices", [None, [0, 3]])
def test_matches_xgrammar_cpu_op(dtype, indices):
    xgrammar = pytest.importorskip("xgrammar", reason="xgrammar is not installed on the GPU machine")
    generator = torch.Generator().manual_seed(17)
    vocab_size, num_words = 2000, 63  # 63 * 32 = 2016 >= vocab: where xgrammar and we agree
    logits = random_logits(5, vocab_size, dtype, generator)
    bitmask = random_bitmask(5, num_words, 0.2, generator)
    ours, _ = run_both(logits, bitmask, indices)
    theirs = logits.clone()
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask, indices=indices)
    assert torch.equal(ours, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 7, 64, 512])
def test_gpu_large_vocab_matches_reference(dtype, num_rows):
    generator = torch.Generator().manual_seed(num_rows)
    vocab_size = 128_256
    logits = random_logits(num_rows, vocab_size, dtype, generator)
    bitmask = random_bitmask(num_rows, triton.cdiv(vocab_size, 32), 0.01, generator)
    bitmask[:, ::3] = 0
    indices = torch.arange(0, num_rows, 2, dtype=torch.int32)
    for index in (None, indices):
        for whole_words in (True, False):
            ours, expected = run_both(logits, bitmask, index, device="cuda", whole_words=whole_words)
            assert torch.equal(ours, expected)


@pytest.mark.gpu
def test_gpu_kernel_replays_in_a_cuda_graph():
    generator = torch.Generator().manual_seed(3)
    logits = random_logits(8, 5000, torch.float32, generator).cuda()
    bitmask = torch.full((8, 157), -1, dtype=torch.int32, device="cuda")
    indices = torch.full((8,), -1, dtype=torch.int32, device="cuda")
    apply_token_bitmask(logits.clone(), bitmask, indices)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_token_bitmask(logits, bitmask, indices)
    fresh = random_logits(8, 5000, torch.float32, generator)
    new_mask = random_bitmask(8, 157, 0.3, generator)
    logits.copy_(fresh)
    bitmask.copy_(new_mask)
    indices.copy_(torch.tensor([5, 0, -1, -1, -1, -1, -1, -1], dtype=torch.int32))
    graph.replay()
    expected = fresh.clone()
    apply_token_bitmask_reference(expected, new_mask, [5, 0])
    assert torch.equal(logits.cpu(), expected)
