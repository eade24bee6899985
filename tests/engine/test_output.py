"""Text output: incremental detokenization (UTF-8 safe) and stop strings across token boundaries."""

from __future__ import annotations

import random
import time

import pytest
from enginecore_helpers import greedy, output_text, output_tokens, run_to_completion
from loraplex.engine.output.detokenizer import IncrementalDetokenizer
from loraplex.engine.output.stop_strings import StopStringMatcher
from loraplex.engine.protocol import EngineRequest, FinishReason

TEXTS = [
    "Hello, world! 😀🎉 rocket 🚀 done.",
    "中文测试：你好，世界。日本語のテキストも。한국어도.",
    "Mixed: naïve café — 👩‍👩‍👧 family emoji, ½ and ∑ symbols.",
    "  leading spaces and\nnew lines\n\tand tabs",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode_and_never_breaks_utf8(smol, text):
    ids = smol.tokenizer.encode(text)
    prompt = smol.tokenizer.encode("Say:")
    detok = IncrementalDetokenizer(smol.tokenizer, prompt)
    deltas = [detok.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == smol.tokenizer.decode(ids)
    assert sum(1 for d in deltas if d == "") > 0 or text.isascii()  # multi-byte chars span tokens


class _WrapperOnly:
    """The bundled tokenizer seen only through transformers' `decode` (no Rust tokenizer to call directly)."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_rust_decode_streams_the_same_text_as_the_transformers_wrapper(smol, skip_special_tokens):
    """The detokenizer calls the Rust tokenizer itself where transformers' decode adds nothing to it: every delta
    is the same as through the wrapper, special tokens, broken UTF-8 and random ids included."""
    tokenizer = smol.tokenizer
    assert tokenizer.clean_up_tokenization_spaces is False and tokenizer.backend_tokenizer is not None
    rng = random.Random(7)
    specials = tokenizer.all_special_ids
    streams = [tokenizer.encode(text) for text in TEXTS]
    streams += [[rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tokenizer)) for _ in range(200)]
                for _ in range(5)]
    for ids in streams:
        prompt = ids[:3]
        fast = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
        wrapped = IncrementalDetokenizer(_WrapperOnly(tokenizer), prompt, skip_special_tokens)
        assert [fast.add(t) for t in ids] == [wrapped.add(t) for t in ids]
        assert fast.text == wrapped.text


def test_stop_string_split_over_feeds_is_found_and_held_back():
    matcher = StopStringMatcher(["STOP", "\n\n"])
    emitted = [matcher.feed(piece) for piece in ["Hello S", "T", "O", "P and more"]]
    assert emitted == ["Hello ", "", "", ""]
    assert matcher.matched == "STOP"
    partial = StopStringMatcher(["STOP"])
    assert partial.feed("abc ST") == "abc "
    assert partial.feed("ay") == "STay"
    assert partial.flush() == ""


def test_stop_string_across_token_boundaries_in_the_engine(smol, chat_prompt_ids):
    prompt = chat_prompt_ids[1]  # a haiku: words of several characters
    engine = smol.engine()
    full = run_to_completion(engine, [EngineRequest("full", prompt, greedy(30))])["full"]
    text = output_text(full)
    tokens = output_tokens(full)
    # A stop string starting inside one multi-character token and ending in the next ones.
    ends = [len(smol.tokenizer.decode(tokens[: i + 1])) for i in range(len(tokens))]
    stop = None
    for i in range(1, len(tokens) - 2):
        if ends[i] - ends[i - 1] >= 3:
            candidate = text[ends[i] - 2 : ends[i] + 2]
            if text.index(candidate) == ends[i] - 2:  # its first occurrence: the cut point is clear
                stop = candidate
                break
    assert stop is not None and len(stop) == 4
    out = run_to_completion(engine, [EngineRequest("stopped", prompt, greedy(30, stop=[stop]))])["stopped"]
    assert output_text(out) == text[: text.index(stop)]
    last = out[-1].choices[-1]
    assert last.finish_reason == FinishReason.STOP and last.stop_reason == stop


def test_eos_and_stop_token_ids_end_with_stop(smol, chat_prompt_ids):
    engine = smol.engine()
    out = run_to_completion(engine, [EngineRequest("eos", chat_prompt_ids[6], greedy(200))])["eos"]
    final = out[-1].choices[-1]
    assert final.finish_reason == FinishReason.STOP and final.stop_reason is None
    assert output_tokens(out)[-1] == smol.tokenizer.eos_token_id
    tokens = output_tokens(out)
    stop_id = tokens[3]
    out2 = run_to_completion(engine, [EngineRequest("sid", chat_prompt_ids[6], greedy(200, stop_token_ids=[stop_id]))])
    assert output_tokens(out2["sid"]) == tokens[: tokens.index(stop_id) + 1]
    assert out2["sid"][-1].choices[-1].stop_reason == stop_id


@pytest.mark.parametrize("stuck", ["lone byte", "special"])
def test_tokens_that_never_make_text_do_not_grow_the_decoded_window(smol, stuck):
    # a tenant forcing a lone byte token (logit_bias) or a skipped special token for thousands of steps: each
    # token re-decoded the whole held-back tail (quadratic, on the API server's event loop)
    tokenizer = smol.tokenizer
    token = tokenizer.convert_tokens_to_ids("¡" if stuck == "lone byte" else "<|im_start|>")  # ¡: byte 0xA1
    if stuck == "lone byte":
        assert tokenizer.decode([token]).endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"))
    started = time.perf_counter()
    for _ in range(3_000):
        detok.add(token)
        assert len(detok.token_ids) - detok.prefix_offset <= 16
    assert time.perf_counter() - started < 1.0
    text = "".join(detok.add(t) for t in tokenizer.encode(" back to words"))
    assert text.endswith("back to words")
