"""Incremental detokenization that never emits a broken UTF-8 sequence.

Decodes a short window of recent tokens twice, with and without the new
ones, and emits the difference once it no longer ends in U+FFFD (a byte
sequence cut in the middle of a character, as BPE byte tokens do for
emoji and CJK). The window starts a few tokens back so word-boundary
rules of BPE/SentencePiece decoders (a leading space, a merged prefix)
apply as they would to the whole text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_CONTEXT_TOKENS = 5
# Tokens held back waiting for a character to complete, at most: a UTF-8 character is at most 4 byte tokens, so
# past this the bytes never will (a tenant forcing a lone byte token with logit_bias, say), or the tokens decode
# to nothing (special tokens skipped). Uncapped, every later token re-decoded the whole growing tail.
_MAX_PENDING_TOKENS = 8


def _decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """Token ids to text. Through the Rust tokenizer's own `decode` where transformers' wraps it and adds nothing
    (a fast tokenizer that does not clean up spaces): ~3 us a call against ~9 through the wrapper, and a streamed
    token takes two calls in every API server."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the newly complete text (maybe empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        incomplete = len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd")
        # past the cap, what there is goes out (U+FFFD for bytes that never made a character) and the window moves on
        if incomplete and len(self.token_ids) - self.read_offset < _MAX_PENDING_TOKENS:
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        if self.prefix_offset > 64:  # keep the list short; only the window is ever decoded
            drop = self.prefix_offset
            self.token_ids = self.token_ids[drop:]
            self.prefix_offset -= drop
            self.read_offset -= drop
        self.text += delta
        return delta
