"""Speculation's counters per draft position: each verified draft counts at its position, each accepted one
too (accepted drafts are a prefix of the drafts), beside the totals; off, there are no positions."""

from __future__ import annotations

from loraplex.engine.protocol import SamplingParams
from loraplex.engine.sequence import Sequence
from loraplex.engine.spec.policy import Speculation, SpeculationConfig


def decode() -> Sequence:
    return Sequence("r0", 0, list(range(12)), SamplingParams(max_tokens=64, temperature=0.0), "t", None,
                    ("t", None, ""), 0.0)


def test_drafts_and_acceptances_count_at_their_positions() -> None:
    speculation = Speculation.from_config(SpeculationConfig("auto", num_tokens=4))
    assert speculation is not None
    seq = decode()
    for num_drafts, num_accepted in [(4, 2), (2, 2), (3, 0), (1, 1)]:
        speculation.record(seq, num_drafts, num_accepted)
    stats = speculation.stats()
    assert stats["spec_decode_num_draft_tokens_per_pos"] == [4, 3, 2, 1]
    assert stats["spec_decode_num_accepted_tokens_per_pos"] == [3, 2, 0, 0]
    assert sum(stats["spec_decode_num_draft_tokens_per_pos"]) == stats["spec_decode_num_draft_tokens_total"] == 10
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens_total"]
    assert stats["spec_decode_num_verified_rows_total"] == 4


def test_speculation_off_has_no_positions() -> None:
    assert Speculation.from_config(SpeculationConfig("off")) is None
    stats = Speculation.empty_stats()
    assert stats["spec_decode_num_accepted_tokens_per_pos"] == []
    assert stats["spec_decode_num_draft_tokens_per_pos"] == []


def test_auto_drafts_on_a_gpu_where_verification_steps_replay_graphs() -> None:
    assert Speculation.from_config(SpeculationConfig(mode="auto", device_type="cuda")) is not None
    assert Speculation.from_config(SpeculationConfig(mode="ngram", device_type="cuda")) is not None
    assert Speculation.from_config(SpeculationConfig(mode="auto", device_type="cpu")) is not None
    assert not SpeculationConfig(mode="off", device_type="cuda").drafts
