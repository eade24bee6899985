"""Engine logprobs in the two OpenAI shapes: chat (`content: [...]`) and legacy completions."""

from __future__ import annotations

import math
from typing import Any

from loraplex.engine.protocol import TokenLogprob


class TokenTexts:
    """Decoded text of single token ids, cached (decoding one id costs more than a dict lookup)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 200_000:
                self._cache[token_id] = text
        return text


def _finite(value: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number, so clamp like OpenAI does (-9999.0).
    return value if math.isfinite(value) else -9999.0


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> list[dict[str, Any]]:
    out = []
    for entry in entries:
        token = texts(entry.token_id)
        out.append({
            "token": token,
            "logprob": _finite(entry.logprob),
            "bytes": list(token.encode()),
            "top_logprobs": [
                {"token": (t := texts(tid)), "logprob": _finite(lp), "bytes": list(t.encode())} for tid, lp in entry.top
            ],
        })
    return out


class LegacyLogprobs:
    """Accumulates the completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, texts: TokenTexts, start_offset: int = 0) -> None:
        self._texts = texts
        self._offset = start_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add_prompt(self, prompt_ids: list[int], entries: list[TokenLogprob | None]) -> None:
        for token_id, entry in zip(prompt_ids, entries, strict=False):
            if entry is None:
                self._append(token_id, None, None)
            else:
                self._append(token_id, entry.logprob, entry.top)

    def extend(self, other: LegacyLogprobs) -> None:
        """`other`'s entries after these: a prompt's part is built once and shared by all its choices."""
        self.tokens += other.tokens
        self.token_logprobs += other.token_logprobs
        self.top_logprobs += other.top_logprobs
        shift = self._offset
        self.text_offset += other.text_offset if not shift else [offset + shift for offset in other.text_offset]
        self._offset += other._offset

    def add(self, entries: list[TokenLogprob]) -> None:
        for entry in entries:
            self._append(entry.token_id, entry.logprob, entry.top)

    def _append(self, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None) -> None:
        token = self._texts(token_id)
        self.tokens.append(token)
        self.token_logprobs.append(None if logprob is None else _finite(logprob))
        self.top_logprobs.append(None if top is None else {self._texts(t): _finite(lp) for t, lp in top})
        self.text_offset.append(self._offset)
        self._offset += len(token)

    def as_dict(self, start: int = 0) -> dict[str, Any]:
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }

    def __len__(self) -> int:
        return len(self.tokens)
