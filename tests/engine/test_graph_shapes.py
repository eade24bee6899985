"""The padded shapes CUDA graphs are captured for (pure functions: no GPU needed)."""

from __future__ import annotations

from loraplex.engine.cuda.graphs import batch_ladder, extra_token_ladder, mixed_seq_ladder


def test_decode_ladder_covers_every_batch_size():
    ladder = batch_ladder(100)
    assert ladder[:4] == [1, 2, 4, 8] and ladder[-1] == 100
    assert all(any(size >= n for size in ladder) for n in range(1, 101))


def test_mixed_sequence_ladder_is_powers_of_two_and_the_maximum():
    assert mixed_seq_ladder(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert mixed_seq_ladder(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert mixed_seq_ladder(1) == [1]


def test_extra_token_ladder_pads_at_most_twofold_to_256_and_fourfold_up_to_the_step_budget():
    assert extra_token_ladder(512) == [16, 32, 64, 128, 256, 512]
    assert extra_token_ladder(8192) == [16, 32, 64, 128, 256, 1024, 4096, 8192]
    assert extra_token_ladder(10) == [10]
    ladder = extra_token_ladder(2048)
    for extra in range(17, 2049):
        padded = next(size for size in ladder if size >= extra)
        assert padded < (2 if extra <= 256 else 4) * extra
