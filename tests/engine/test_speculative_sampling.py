"""The verifier's sampling rule, the n-gram proposer and the adaptive policy, without a model.

Random rows accept a draft d with probability p(d) and otherwise draw from p
without d: the token's distribution must stay p whatever d is. Checked on a
small synthetic vocabulary with seeded generators; each frequency must lie
within 5 standard errors of its probability (sqrt(p(1-p)/N)): a correct rule
fails that bound with probability about 6e-7 per cell, a wrong one (e.g. the
draft taken outright, or the residual not renormalised) misses it by over ten
standard errors at these sample sizes.
"""

from __future__ import annotations

import math
import random
import time

import pytest
import torch
from grammar_double import FixedSetGrammar
from loraplex.engine.protocol import SamplingParams
from loraplex.engine.sampler import Sampler, draw_with_draft
from loraplex.engine.sequence import Sequence
from loraplex.engine.spec.policy import CAUTIOUS_TOKENS, Speculation, SpeculationConfig
from loraplex.engine.spec.proposer import MAX_CANDIDATES, UNIQUE_BELOW, NgramProposer
from loraplex.engine.spec.verify import verify_drafts

VOCAB = 6
NUM_SAMPLES = 4_000


def _sequence(sampling: SamplingParams, seed: int) -> Sequence:
    seq = Sequence("r", 0, [1, 2, 3], sampling, "tenant", None, ("tenant", None, None), 0.0)
    seq.generator = random.Random(seed)
    return seq


def _assert_matches(counts: list[int], probs: torch.Tensor, total: int) -> None:
    for token, count in enumerate(counts):
        p = float(probs[token])
        bound = 5 * math.sqrt(max(p * (1 - p), 1e-12) / total) + 1e-9
        assert abs(count / total - p) <= bound, (token, count / total, p)


@pytest.mark.parametrize(("draft", "sampling"), [
    (4, SamplingParams(temperature=1.0)),                     # the likeliest token drafted
    (2, SamplingParams(temperature=0.7, top_p=0.9)),          # a draft top-p cuts away: never taken
    (3, SamplingParams(temperature=1.3, top_k=4, min_p=0.05)),
])
def test_one_position_keeps_the_target_distribution_whatever_the_draft(draft: int, sampling: SamplingParams) -> None:
    logits = torch.tensor([[1.2, 0.1, -0.5, 0.8, 2.0, -1.0]])
    sampler = Sampler(VOCAB, VOCAB)
    target = Sampler._random_probs(logits.clone(), [_sequence(sampling, 0)])[0]
    target = target / target.sum()
    seq = _sequence(sampling, seed=1234 + draft)
    counts = [0] * VOCAB
    for _ in range(NUM_SAMPLES):
        seq.drawn_at = -1  # a fresh uniform, as a new position would draw
        token, _ = sampler.verify_token(logits, seq, draft)
        counts[token] += 1
    _assert_matches(counts, target, NUM_SAMPLES)


def test_draft_is_accepted_with_its_probability_and_a_certain_draft_always() -> None:
    probs = torch.tensor([0.1, 0.6, 0.3])
    generator = torch.Generator().manual_seed(7)
    uniforms = torch.rand(NUM_SAMPLES, generator=generator).tolist()
    accepted = sum(draw_with_draft(probs, 1, u) == 1 for u in uniforms)
    _assert_matches([NUM_SAMPLES - accepted, accepted], torch.tensor([0.4, 0.6]), NUM_SAMPLES)
    certain = torch.tensor([0.0, 1.0, 0.0])
    assert all(draw_with_draft(certain, 1, u) == 1 for u in uniforms[:500])
    # A draft with no mass is never taken; the rest keep their shares.
    assert all(draw_with_draft(certain, 0, u) == 1 for u in uniforms[:500])


def test_a_walk_over_two_drafts_keeps_each_position_conditional_distribution() -> None:
    """Row 0 scores the first position, row 1 the next one given that the first token was draft 0: the first
    token must follow row 0's distribution, and the second (produced only after draft 0) row 1's."""
    logits = torch.tensor([[0.3, 1.5, -0.2, 0.9, 0.0, -1.1],
                           [2.2, -0.3, 0.4, 0.1, 1.0, 0.5],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    drafts = [1, 4]
    sampling = SamplingParams(temperature=1.0, max_tokens=100)
    sampler = Sampler(VOCAB, VOCAB)
    p0 = logits[0].softmax(-1)
    p1 = logits[1].softmax(-1)
    seq = _sequence(sampling, seed=99)
    first_counts, second_counts = [0] * VOCAB, [0] * VOCAB
    for _ in range(NUM_SAMPLES):
        seq.token_ids = [1, 2, 3]
        seq.spec_token_ids = list(drafts)
        seq.drawn_at = -1  # the positions are drawn afresh each round

        def add_token(token: int, logprob: object) -> bool:
            seq.token_ids.append(token)
            return False

        verify_drafts(seq, logits, sampler, add_token, lambda: False)
        produced = seq.token_ids[3:]
        first_counts[produced[0]] += 1
        if produced[0] == drafts[0]:
            second_counts[produced[1]] += 1
        assert len(produced) in (1, 2, 3)
    _assert_matches(first_counts, p0, NUM_SAMPLES)
    _assert_matches(second_counts, p1, sum(second_counts))


def test_greedy_walk_stops_at_the_first_draft_the_argmax_refuses() -> None:
    logits = torch.full((4, VOCAB), -5.0)
    for row, best in enumerate([2, 5, 1, 3]):
        logits[row, best] = 5.0
    seq = _sequence(SamplingParams(temperature=0.0, max_tokens=100), seed=0)
    seq.spec_token_ids = [2, 5, 0]

    def add_token(token: int, logprob: object) -> bool:
        seq.token_ids.append(token)
        return False

    assert not verify_drafts(seq, logits, Sampler(VOCAB, VOCAB), add_token, lambda: False)
    assert seq.token_ids[3:] == [2, 5, 1]  # two drafts kept, the third replaced by the argmax


def test_ngram_proposer_continues_the_latest_match_longest_first() -> None:
    proposer = NgramProposer(1, 3)
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert proposer.propose([7, 8, 9, 4, 1, 8, 9, 4, 2, 8, 9, 4], 2) == [2, 8]  # latest occurrence wins
    # A match shorter than UNIQUE_BELOW tokens drafts only where it occurred once: a repeated pair is a
    # common phrase (here 8, 9 twice), and no shorter match stands in for it.
    assert proposer.propose([7, 8, 9, 1, 8, 9, 2, 8, 9], 2) == []
    assert proposer.propose([7, 8, 9, 1, 5, 9], 2) == [1, 5]        # a pair seen once drafts
    assert proposer.propose([5, 6, 7, 8], 4) == []                      # nothing repeats: no draft
    assert proposer.propose([4, 5, 6, 9, 5, 6], 0) == []
    # The longest n-gram decides over a later single-token match.
    assert NgramProposer(1, 2).propose([3, 4, 10, 9, 4, 11, 3, 4], 1) == [10]
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


def _latest_longest_match(token_ids: list[int], max_tokens: int, min_n: int, max_n: int) -> list[int]:
    """The proposer's rule written the slow, obvious way: for n from max_n down, the latest earlier position whose
    n tokens ending there equal the last n; none where such a match of fewer than UNIQUE_BELOW tokens has another
    earlier occurrence."""
    length = len(token_ids)
    if max_tokens <= 0 or length <= min_n:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        ends = [end for end in range(length - 2, n - 2, -1) if token_ids[end - n + 1 : end + 1] == token_ids[length - n :]]
        if ends:
            return [] if n < UNIQUE_BELOW and len(ends) > 1 else token_ids[ends[0] + 1 : ends[0] + 1 + max_tokens]
    return []


def test_ngram_proposer_equals_the_obvious_search_on_random_sequences() -> None:
    generator = torch.Generator().manual_seed(11)
    for i in range(3000):
        length, vocab = int(torch.randint(0, 40, (1,), generator=generator)), [2, 3, 5, 50][i % 4]
        tokens = torch.randint(0, vocab, (length,), generator=generator).tolist()
        min_n = 1 + i % 3
        max_n, max_tokens = min_n + i % 4, i % 6
        expected = _latest_longest_match(tokens, max_tokens, min_n, max_n)
        assert NgramProposer(min_n, max_n).propose(tokens, max_tokens) == expected, (tokens, min_n, max_n)


def test_ngram_proposer_keeping_its_index_between_steps_proposes_as_a_fresh_search() -> None:
    """A sequence keeps its proposer's index and grows a few tokens a step (by one, or several when drafts are
    accepted): each proposal equals the obvious search over the tokens so far."""
    generator = torch.Generator().manual_seed(12)
    for i in range(300):
        min_n = 1 + i % 3
        proposer, vocab = NgramProposer(min_n, min_n + i % 3), [2, 3, 7, 50][i % 4]
        state = proposer.new_state()
        tokens = torch.randint(0, vocab, (int(torch.randint(0, 30, (1,), generator=generator)),),
                               generator=generator).tolist()
        while len(tokens) < 80:
            expected = _latest_longest_match(tokens, 4, min_n, proposer.max_n)
            assert proposer.propose(tokens, 4, state) == expected, (tokens, min_n, proposer.max_n)
            tokens += torch.randint(0, vocab, (1 + i % 3,), generator=generator).tolist()


def test_ngram_proposer_looks_at_the_latest_places_only() -> None:
    # The same 3-gram ends 200 times, each after a different token; the one place also matching a 4-gram lies
    # past the latest MAX_CANDIDATES of them and is not looked at: the latest 3-gram match is proposed.
    filler = [token for i in range(200) for token in (100 + i, 1, 2, 3, 7)]
    tokens = [9, 1, 2, 3, 8, *filler, 9, 1, 2, 3]
    assert NgramProposer(3, 4).propose(tokens, 1) == [7]
    assert NgramProposer(3, 4).propose([9, 1, 2, 3, 8, *filler[: 5 * (MAX_CANDIDATES - 1)], 9, 1, 2, 3], 1) == [8]


def test_ngram_proposer_cost_does_not_grow_with_a_crafted_prompt() -> None:
    """A tenant's prompt of 64,000 tokens repeating one pair, then tokens whose n-grams end in its last token but
    match nowhere: a search from that token's every occurrence took ~30 ms a proposal on a 2-core box, every
    step; with the index kept between steps a proposal looks up the last n-gram and at most MAX_CANDIDATES places."""
    proposer = NgramProposer(2, 4)
    tokens, state = [1, 2] * 32_000, proposer.new_state()
    assert proposer.propose(tokens, 4, state) == [1, 2]  # the index is built once, at the first proposal
    start = time.perf_counter()
    for step in range(200):
        tokens += [10 + step, 2]  # a new pair each step, ending in the token the prompt holds 32,000 times
        assert proposer.propose(tokens, 4, state) == []
    assert (time.perf_counter() - start) / 200 < 1e-3


def _speculation(mode: str, max_model_len: int = 64) -> Speculation:
    speculation = Speculation.from_config(SpeculationConfig(mode=mode, num_tokens=4, ngram_min=1, ngram_max=3,
                                                            device_type="cpu", max_model_len=max_model_len))
    assert speculation is not None
    return speculation


def _decoding(token_ids: list[int], max_tokens: int = 32) -> Sequence:
    seq = Sequence("r", 0, token_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), "t", None, (), 0.0)
    seq.num_computed_tokens = len(token_ids) - 1  # a decode: only its last token is new
    return seq


def test_auto_stops_drafting_for_a_sequence_whose_drafts_are_rejected_then_tries_again_later() -> None:
    speculation = _speculation("auto")
    seq = _decoding([1, 2, 3, 1, 2, 3, 1, 2])
    assert speculation.propose(seq, 16) == [3, 1, 2]
    rejections = 0
    while seq.spec_resume_at == 0:
        speculation.record(seq, 3, 0)
        rejections += 1
    assert rejections == 4  # the moving share fell under the floor after a few fully rejected steps
    assert seq.spec_resume_at == seq.num_output_tokens + 16
    assert speculation.propose(seq, 16) == []
    seq.token_ids += [3] * 16  # 16 more output tokens: drafting resumes, a second switch-off lasts twice as long
    seq.num_computed_tokens = len(seq.token_ids) - 1
    assert speculation.propose(seq, 16) != []
    while seq.spec_cooldown == 16:
        speculation.record(seq, 3, 0)
    assert seq.spec_cooldown == 32
    # Fixed `ngram` mode keeps drafting whatever the acceptance.
    fixed = _speculation("ngram")
    other = _decoding([1, 2, 3, 1, 2])
    for _ in range(10):
        fixed.record(other, 3, 0)
    assert fixed.propose(other, 16) == [3, 1, 2]


def test_auto_drafts_only_long_matches_for_a_while_after_a_draft_rejected_whole() -> None:
    """A draft rejected whole makes `auto` cautious for CAUTIOUS_TOKENS output tokens: a 2-token match no
    longer drafts (nor tells overlapped scheduling to wait for it), a match of UNIQUE_BELOW tokens still does;
    a draft accepted in part changes nothing, and `ngram` is never cautious."""
    speculation, fixed = _speculation("auto", max_model_len=256), _speculation("ngram", max_model_len=256)
    short = _decoding([5, 1, 2, 7, 8, 1, 2], 256)      # the pair 1, 2 seen once before: a 2-token match
    long = _decoding([5, 1, 2, 3, 7, 8, 1, 2, 3], 256)  # 1, 2, 3 seen once before: a 3-token match
    assert speculation.propose(short, 16) == [7, 8, 1, 2]
    speculation.record(short, 3, 1)
    assert speculation.propose(short, 16) == [7, 8, 1, 2]  # accepted in part: no caution
    speculation.record(short, 3, 0)
    assert short.spec_resume_at == 0  # not paused: the moving share is still above the floor
    assert speculation.propose(short, 16) == [] and not speculation.may_draft([short])
    assert fixed.propose(short, 16) == [7, 8, 1, 2]
    speculation.record(long, 3, 0)
    assert speculation.propose(long, 16) == [7, 8, 1, 2]
    short.token_ids += [4, 6, 11] + [9] * CAUTIOUS_TOKENS + [4, 6]  # a fresh 2-token match, the caution over
    short.num_computed_tokens = len(short.token_ids) - 1
    assert speculation.propose(short, 16) == [11, 9, 9, 9]


def test_auto_leaves_grammar_rows_undrafted_and_says_when_a_step_would_draft() -> None:
    """`auto` drafts plain rows, not grammar rows (the jump-forward already takes what a grammar forces; on a GPU
    their verification also runs the grammar on the host after the step), on the CPU too; `may_draft` tells overlapped scheduling whether the running decodes would draft, from the tokens
    they have (one may still be in flight), so that steps run ahead only while none would."""
    def gpu(mode: str) -> Speculation:
        speculation = Speculation.from_config(SpeculationConfig(mode=mode, num_tokens=4, ngram_min=1, ngram_max=3,
                                                                device_type="cuda", max_model_len=64))
        assert speculation is not None
        return speculation

    auto, fixed = gpu("auto"), gpu("ngram")
    plain, constrained = _decoding([1, 2, 3, 1, 2]), _decoding([1, 2, 3, 1, 2])
    constrained.matcher = FixedSetGrammar([[3], [1], [2]]).new_matcher()
    assert auto.propose(plain, 16) == [3, 1, 2]
    assert auto.propose(constrained, 16) == []
    assert fixed.propose(constrained, 16) == [3, 1, 2]  # `ngram` drafts every row
    cpu_auto = _speculation("auto")
    assert cpu_auto.propose(plain, 16) == [3, 1, 2] and cpu_auto.propose(constrained, 16) == []
    in_flight = _decoding([1, 2, 3, 1, 2])
    in_flight.num_computed_tokens = len(in_flight.token_ids)  # its next token is being sampled
    assert auto.may_draft([in_flight]) and auto.may_draft([_decoding([5, 6, 7]), plain])
    assert not auto.may_draft([_decoding([5, 6, 7, 8])])  # nothing repeats: no draft
    assert not auto.may_draft([constrained])
    assert not auto.may_draft([plain] * 52)  # 52 decodes x (1 + 4) rows pass the GPU's compute bound
    assert fixed.may_draft([plain] * 52)
    plain.spec_resume_at = plain.num_output_tokens + 16  # switched off for a while
    assert not auto.may_draft([plain])


def test_auto_drafts_nothing_in_a_compute_bound_step_and_drafts_respect_the_limits() -> None:
    auto, fixed = _speculation("auto"), _speculation("ngram")
    assert auto.allows_step(6) and not auto.allows_step(7)  # CPU: 7 decodes x (1 + 4) rows pass 32
    assert fixed.allows_step(500)
    seq = _decoding([5, 6, 7, 8, 5, 6, 7, 8, 5], max_tokens=3)
    assert fixed.propose(seq, 16) == [6, 7]  # 3 tokens of room left: two drafts and the token verification adds
    assert fixed.propose(seq, 1) == [6]      # the step's token budget
    near_the_end = _decoding(list(range(20)) * 3 + [0, 1, 2], max_tokens=100)  # 63 of 64 positions used
    assert fixed.propose(near_the_end, 16) == []
    child = _decoding([1, 2, 1, 2])
    child.parent = seq  # a fork child still shares its parent's last block
    assert fixed.propose(child, 16) == []
    seeded = _decoding([1, 2, 1, 2])
    seeded.sampling = SamplingParams(temperature=0.8, seed=7)  # its tokens must depend on its seed alone
    assert fixed.propose(seeded, 16) == []
    assert Speculation.from_config(SpeculationConfig(mode="off")) is None
    with pytest.raises(ValueError):
        Speculation.from_config(SpeculationConfig(mode="sometimes"))


def test_auto_with_overlapped_steps_drafts_only_in_steps_of_few_decodes() -> None:
    """A step with drafts cannot run ahead: with overlap on, `auto` drafts only where the step is a few rows."""
    from loraplex.engine.spec.policy import OVERLAP_MAX_DRAFTING_DECODES

    overlapped = Speculation.from_config(SpeculationConfig(mode="auto", device_type="cuda", overlapped=True))
    plain = Speculation.from_config(SpeculationConfig(mode="auto", device_type="cuda"))
    fixed = Speculation.from_config(SpeculationConfig(mode="ngram", device_type="cuda", overlapped=True))
    assert overlapped.allows_step(OVERLAP_MAX_DRAFTING_DECODES)
    assert not overlapped.allows_step(OVERLAP_MAX_DRAFTING_DECODES + 1)
    assert plain.allows_step(OVERLAP_MAX_DRAFTING_DECODES + 1) and plain.allows_step(51) and not plain.allows_step(52)
    assert fixed.allows_step(64), "ngram drafts whatever the step"
    assert overlapped.num_skipped_steps == 1
    running = [_decoding([1, 2, 3, 1, 2]) for _ in range(OVERLAP_MAX_DRAFTING_DECODES + 1)]
    assert not overlapped.may_draft(running) and overlapped.may_draft(running[:-1])
