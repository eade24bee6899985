"""min_tokens, stop_token_ids, include_stop_str_in_output and skip_special_tokens in the engine (SmolLM2)."""

from __future__ import annotations

import pytest
from enginecore_helpers import greedy, output_text, output_tokens, run_to_completion
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.output.stop_strings import StopStringMatcher
from loraplex.engine.protocol import EngineRequest, FinishReason, SamplingParams


def _last(outputs):  # type: ignore[no-untyped-def]
    return outputs[-1].choices[-1]


def _eos_ended(smol, prompt, max_tokens=60):  # type: ignore[no-untyped-def]
    """A greedy answer that ends on EOS well before max_tokens (the baseline min_tokens must stretch)."""
    out = run_to_completion(smol.engine(), [EngineRequest("base", prompt, greedy(max_tokens))])["base"]
    assert _last(out).finish_reason == FinishReason.STOP and _last(out).stop_reason is None
    return output_tokens(out)


def test_min_tokens_masks_eos_until_reached(smol, chat_prompt_ids):
    prompt = chat_prompt_ids[0]
    base = _eos_ended(smol, prompt)
    want = len(base) + 5
    out = run_to_completion(smol.engine(), [EngineRequest("min", prompt, greedy(want + 40, min_tokens=want))])["min"]
    tokens = output_tokens(out)
    assert len(tokens) >= want
    eos = set(smol.engine().eos_token_ids)
    assert not eos & set(tokens[: want])  # EOS never drawn before min_tokens (it was, greedily, at len(base))
    assert tokens[: len(base) - 1] == base[: len(base) - 1]  # the same greedy path up to where EOS came


def test_min_tokens_masks_stop_token_ids_too(smol, chat_prompt_ids):
    prompt = chat_prompt_ids[0]
    base = _eos_ended(smol, prompt)
    stop_token = base[2]  # the third token of the greedy answer
    stopped = run_to_completion(smol.engine(), [EngineRequest("s", prompt, greedy(60, stop_token_ids=[stop_token]))])
    assert _last(stopped["s"]).stop_reason == stop_token and len(output_tokens(stopped["s"])) == 3
    later = run_to_completion(smol.engine(), [
        EngineRequest("m", prompt, greedy(60, stop_token_ids=[stop_token], min_tokens=6))])["m"]
    tokens = output_tokens(later)
    assert stop_token not in tokens[:6]
    assert len(tokens) > 6


def test_min_tokens_yields_to_a_grammar_that_only_allows_its_end(smol):
    """With nothing but EOS allowed the row keeps EOS (masking it would leave no token to draw)."""
    import torch
    from loraplex.engine.sampler import Sampler
    from loraplex.engine.sequence import Sequence

    seq = Sequence("r", 0, [1, 2, 3], SamplingParams(min_tokens=5), "t", None, (), 0.0)
    seq.min_tokens_ban_ids = [2]
    only_eos = torch.full((1, 8), float("-inf"))
    only_eos[0, 2] = 0.0
    Sampler._apply_min_tokens(Sampler(8, 8), only_eos, [seq])
    assert only_eos[0, 2] == 0.0
    open_row = torch.zeros((1, 8))
    Sampler._apply_min_tokens(Sampler(8, 8), open_row, [seq])
    assert open_row[0, 2] == float("-inf") and bool(torch.isfinite(open_row[0, :2]).all())


def test_stop_token_text_kept_only_when_asked(smol, chat_prompt_ids):
    prompt = chat_prompt_ids[0]
    base = _eos_ended(smol, prompt)
    stop_token = base[3]
    text_of = smol.tokenizer.decode(base[:4])
    cut = run_to_completion(smol.engine(), [EngineRequest("c", prompt, greedy(60, stop_token_ids=[stop_token]))])["c"]
    kept = run_to_completion(smol.engine(), [EngineRequest("k", prompt, greedy(
        60, stop_token_ids=[stop_token], include_stop_str_in_output=True))])["k"]
    assert output_text(kept) == text_of
    assert output_text(cut) == smol.tokenizer.decode(base[:3])


def test_special_token_text_with_skip_special_tokens_off(smol, chat_prompt_ids):
    """EOS ignored, then stopped by its id with its text kept: `<|im_end|>` shows only when specials are kept."""
    prompt = chat_prompt_ids[0]
    eos = smol.tokenizer.eos_token_id
    common = {"ignore_eos": True, "stop_token_ids": [eos], "include_stop_str_in_output": True}
    shown = run_to_completion(smol.engine(), [EngineRequest("s", prompt, greedy(60, skip_special_tokens=False, **common))])
    hidden = run_to_completion(smol.engine(), [EngineRequest("h", prompt, greedy(60, **common))])
    assert output_text(shown["s"]).endswith(smol.tokenizer.eos_token)
    assert smol.tokenizer.eos_token not in output_text(hidden["h"])
    assert output_text(shown["s"]) == output_text(hidden["h"]) + smol.tokenizer.eos_token


def test_stop_string_kept_when_asked():
    matcher = StopStringMatcher(["STOP"], include_in_output=True)
    emitted = [matcher.feed(piece) for piece in ["Hello S", "T", "O", "P and more"]]
    assert "".join(emitted) == "Hello STOP" and matcher.matched == "STOP"


@pytest.mark.parametrize(("field", "value"), [("min_tokens", -1), ("stop_token_ids", [-3]), ("stop_token_ids", [True])])
def test_bad_values_name_their_field(field, value):
    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(**{field: value}).validate()
    assert raised.value.param == field
