"""The reasoning/content split at a model family's think markers."""

from __future__ import annotations

import pytest
from loraplex.platform.reasoning_parser import (
    ReasoningFormat,
    ReasoningParser,
    reasoning_format_for,
    reasoning_markers,
)
from transformers import AutoTokenizer

THINK = ReasoningFormat()


@pytest.fixture(scope="module")
def tokenizer(smollm_path):
    return AutoTokenizer.from_pretrained(smollm_path)


TEXT = "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4."


def run(parser: ReasoningParser, text: str, step: int) -> tuple[str, str]:
    reasoning = content = ""
    for i in range(0, len(text), step):
        delta = parser.feed(text[i:i + step])
        reasoning += delta.reasoning
        content += delta.content
    delta = parser.finish()
    return reasoning + delta.reasoning, content + delta.content


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_split_streamed_at_any_chunking(step):
    reasoning, content = run(ReasoningParser(THINK), TEXT, step)
    assert reasoning == "\nThe user wants 2+2. That is 4.\n"
    assert content == "The answer is 4."


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_template_that_opens_the_block(step):
    reasoning, content = run(ReasoningParser(THINK, starts_inside=True), "plan the answer</think>Done.", step)
    assert (reasoning, content) == ("plan the answer", "Done.")


def test_no_think_block_is_all_content():
    parser = ReasoningParser(THINK)
    assert run(parser, "Hello <think> is just a word here", 2) == ("", "Hello <think> is just a word here")


def test_unclosed_block_stays_reasoning():
    assert run(ReasoningParser(THINK), "<think>still thinking when max_tokens hit", 5) == (
        "still thinking when max_tokens hit", "")


def test_family_lookup_and_markers(tokenizer):
    assert reasoning_format_for("llama") == THINK
    assert reasoning_format_for("gpt_oss").start.startswith("<|channel|>")
    markers = reasoning_markers(tokenizer, THINK)
    assert tokenizer.decode(markers.start_token_ids) == "<think>"
    assert tokenizer.decode(markers.end_token_ids) == "</think>"
    assert markers.starts_inside is False  # SmolLM2's template does not open a think block


class _OpeningTemplate:
    """A tokenizer stand-in whose chat template ends its generation prompt inside <think>."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "<|user|>hi<|assistant|><think>\n"

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_template_opening_the_block_is_detected():
    assert reasoning_markers(_OpeningTemplate(), THINK).starts_inside is True
