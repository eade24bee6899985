"""Sampling: seeds independent of batch mates, filters, penalties, bitmask packing."""

from __future__ import annotations

import random

import pytest
import torch
from enginecore_helpers import output_tokens, run_to_completion, tiny_random_config
from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.protocol import EngineRequest, SamplingParams
from loraplex.engine.runner import StepResult
from loraplex.engine.sampler import Sampler, apply_token_bitmask
from loraplex.engine.sequence import Sequence


@pytest.fixture(scope="module")
def engine_factory(smol):
    config = tiny_random_config(initializer_range=0.02)

    def make() -> LLMEngine:
        return LLMEngine.from_random(config, EngineConfig(num_blocks=128, max_model_len=512), smol.tokenizer)

    return make


def sampled(seed: int | None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True, **kw)


def test_same_seed_same_output_whatever_the_batch_mates(engine_factory):
    prompt = [11, 22, 33, 44, 55]
    alone = run_to_completion(engine_factory(), [EngineRequest("x", prompt, sampled(1234))])
    mates = [EngineRequest(f"m{i}", [i + 3] * (i + 2), sampled(None)) for i in range(6)]
    crowded = run_to_completion(engine_factory(), [*mates[:3], EngineRequest("x", prompt, sampled(1234)), *mates[3:]])
    assert output_tokens(alone["x"]) == output_tokens(crowded["x"])
    other_seed = run_to_completion(engine_factory(), [EngineRequest("x", prompt, sampled(99))])
    assert output_tokens(other_seed["x"]) != output_tokens(alone["x"])


def test_seeded_choices_differ_from_each_other_but_repeat(engine_factory):
    request = lambda: EngineRequest("n", [5, 6, 7], sampled(7, n=2))  # noqa: E731
    first = run_to_completion(engine_factory(), [request()])["n"]
    second = run_to_completion(engine_factory(), [request()])["n"]
    assert output_tokens(first, 0) != output_tokens(first, 1)
    assert output_tokens(first, 1) == output_tokens(second, 1)


def seqs_for(params: list[SamplingParams], history: list[list[int]] | None = None) -> list[Sequence]:
    out = []
    for i, p in enumerate(params):
        tokens = (history or [[1, 2]] * len(params))[i]
        seq = Sequence(f"r{i}", 0, tokens[:1], p, "t", None, (), 0.0)
        seq.token_ids = list(tokens)
        seq.generator = random.Random(i)
        out.append(seq)
    return out


def draw(logits: torch.Tensor, params: list[SamplingParams], history=None, vocab: int | None = None) -> list[int]:
    sampler = Sampler(logits.shape[1], vocab or logits.shape[1])
    result = StepResult()
    seqs = seqs_for(params, history)
    sampler.sample(logits.clone(), seqs, result)
    return [result.sampled[s.seq_id] for s in seqs]


def test_filters_reduce_to_the_argmax_at_their_limits():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(dim=-1).tolist()
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6),
              SamplingParams(temperature=1.0, min_p=1.0), SamplingParams(temperature=0.0)]
    for _ in range(5):
        assert draw(logits, params) == best


def test_top_k_and_top_p_never_leave_their_set():
    logits = torch.linspace(0, 5, 100).repeat(2, 1)
    for _ in range(20):
        k_token, p_token = draw(logits, [SamplingParams(temperature=2.0, top_k=3),
                                         SamplingParams(temperature=1.0, top_p=0.5)])
        assert k_token >= 97
        probs = logits[0].softmax(-1).flip(0).cumsum(0)
        assert 99 - p_token < int((probs < 0.5).sum()) + 1


def test_penalties_push_repeated_tokens_down():
    logits = torch.zeros(3, 10)
    logits[:, 4] = 1.0
    logits[:, 5] = 0.9
    history = [[0, 4, 4], [0, 4], [4, 4]]  # prompt token first, then outputs
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.1),
              SamplingParams(temperature=0.0, presence_penalty=0.2),
              SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    assert draw(logits, params, history) == [5, 5, 5]
    params[0].frequency_penalty = 0.04  # 1.0 - 2 * 0.04 still above 0.9
    assert draw(logits, params, history)[0] == 4


def test_bitmask_packing_matches_xgrammar_and_pads_beyond_the_tokenizer():
    xgr = pytest.importorskip("xgrammar")
    vocab = 70
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    xgr.reset_token_bitmask(bitmask)
    bitmask[0, 0] = 0
    bitmask[0, 1] = 1 << 3      # token 35 only (plus all of word 2: 64..69)
    logits = torch.zeros(1, vocab)
    apply_token_bitmask(logits, bitmask)
    reference = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(reference, bitmask)
    assert torch.equal(logits, reference)
    allowed = (logits[0] > float("-inf")).nonzero().squeeze(1).tolist()
    assert allowed == [35, 64, 65, 66, 67, 68, 69]


class _OnlyToken:
    """A grammar matcher double that allows one token id."""

    def __init__(self, token: int) -> None:
        self.token = token

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        bitmask[row, self.token // 32] = 1 << (self.token % 32)


def test_logit_bias_forces_and_bans_tokens_but_never_unmasks_the_grammar():
    logits = torch.zeros(4, 64)
    logits[:, 7] = 5.0
    params = [SamplingParams(temperature=0.0, logit_bias={3: 100.0}),
              SamplingParams(temperature=0.0, logit_bias={7: -100.0, 9: 0.5}),
              SamplingParams(temperature=1.0, logit_bias={3: 100.0}),
              SamplingParams(temperature=0.0, logit_bias={3: 100.0})]
    sampler = Sampler(64, 64)
    seqs = seqs_for(params)
    seqs[3].matcher = _OnlyToken(7)  # the grammar allows only 7: a +100 bias elsewhere cannot win
    result = StepResult()
    sampler.sample(logits.clone(), seqs, result)
    assert [result.sampled[s.seq_id] for s in seqs] == [3, 9, 3, 7]
    biased = logits.clone()
    Sampler._apply_logit_bias(biased, seqs[1:2] + seqs[:1])  # the next step, rows in another order: kept tensors
    assert biased[0, 7] == -95.0 and biased[0, 9] == 0.5 and biased[1, 3] == 100.0 and biased[1].sum() == 105.0
    assert draw(logits, [SamplingParams(temperature=0.0)]) == [7]  # no bias, no change


@pytest.mark.parametrize(("bias", "message"), [({3: 100.5}, "in \\[-100, 100\\]"), ({-1: 1.0}, "token ids >= 0")])
def test_logit_bias_out_of_range_is_refused(bias, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(logit_bias=bias).validate()


def test_a_vanishing_temperature_draws_the_argmax_without_overflow():
    # 1e-300 is 0 in float32: logits divided by it were inf and the draw NaN (always the last token id)
    logits = torch.zeros(2, 64)
    logits[:, 7] = 5.0
    params = [SamplingParams(temperature=1e-300, seed=3), SamplingParams(temperature=1e-6)]
    for p in params:
        p.validate(64)
    assert [p.temperature for p in params] == [0.0, 0.0]
    assert draw(logits, params) == [7, 7]
    kept = SamplingParams(temperature=1e-5)
    kept.validate(64)
    assert kept.temperature == 1e-5
