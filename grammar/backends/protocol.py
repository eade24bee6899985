"""The grammar backend plug-in: the Protocol each constraint library implements, and what it is given.

A backend compiles a `GrammarSpec` for one tokenizer into a grammar whose
matchers accept tokens, roll back, fill a token bitmask, say when the text is
complete, and name the tokens the grammar forces next (jump-forward).
A backend that cannot enforce a JSON schema exactly refuses it
(`UnsupportedSchemaError`, naming the keyword and where it is): only a backend
that enforces the whole schema may serve a strict request. Backends are
reached through `registry`, never directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from loraplex.grammar.backends.disk_cache import GrammarDiskCache


@dataclass(frozen=True, slots=True)
class Unsupported:
    """A schema feature a backend cannot enforce exactly, and where it is."""

    keyword: str
    path: str
    backend: str
    detail: str = ""

    def message(self) -> str:
        extra = f" ({self.detail})" if self.detail else ""
        return f"keyword {self.keyword!r} at {self.path} is not supported{extra}"


class UnsupportedSchemaError(Exception):
    """Raised by a backend's compile when the spec uses something it cannot enforce exactly."""

    def __init__(self, unsupported: Unsupported) -> None:
        super().__init__(unsupported.message())
        self.unsupported = unsupported


class BackendMatcher(Protocol):
    """One choice's position in a backend grammar."""

    def accept_token(self, token_id: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """The allowed tokens (stop tokens included where the text may end) into `bitmask[row]`."""

    def is_completed(self) -> bool:
        """The text so far is a full match (a stop token would be accepted)."""

    def is_terminated(self) -> bool:
        """Completed, and nothing but a stop token can follow (or a stop token was accepted)."""

    def forced_token_ids(self) -> list[int]:
        """Tokens spelling the text the grammar forces from here (possibly none)."""


class BackendGrammar(Protocol):
    @property
    def backend(self) -> str:
        """The name of the backend that compiled it."""

    @property
    def memory_size_bytes(self) -> int: ...

    def new_matcher(self) -> BackendMatcher: ...


@dataclass(frozen=True, slots=True)
class TokenVocabulary:
    """The tokenizer as a backend reads it: what the matchers around any backend grammar need."""

    token_bytes: list[bytes]     # the bytes each token id spells (b"" for ids past the tokenizer's vocabulary)
    stop_token_ids: list[int]    # ids that end the text
    special_token_ids: set[int]  # ids that spell no text (stop ids among them)


class GrammarBackend(Protocol):
    name: ClassVar[str]
    kinds: ClassVar[frozenset[str]]  # the GrammarKinds it compiles

    @classmethod
    def unsupported(cls, schema: Any) -> Unsupported | None:
        """The first JSON-schema feature this backend would not enforce exactly; None if it enforces all
        (or it says so only when compiling)."""

    def vocabulary(self) -> TokenVocabulary:
        """The served tokenizer, read as this backend reads it."""

    def compile(self, kind: str, payload: Any, timeout_s: float, *, exact: bool = True) -> BackendGrammar:
        """Compile; ValueError (bad input), UnsupportedSchemaError, or TimeoutError (stopped after `timeout_s`).

        `exact=False` lets a backend ignore JSON-schema keywords it does not implement.
        """

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class TokenizerContext:
    """What every backend needs about the served tokenizer."""

    tokenizer: Any  # a Hugging Face fast tokenizer
    vocab_size: int  # the model's logits width (bitmask width), >= the tokenizer's vocabulary
    disk_cache: GrammarDiskCache | None = None  # compiled grammars shared with the host's other processes


class BackendType(Protocol):
    """What the registry holds: a backend class, built once per tokenizer."""

    # the class's attributes (a class object can match a protocol's plain attributes, never its ClassVars)
    name: str
    kinds: frozenset[str]

    def __call__(self, context: TokenizerContext) -> GrammarBackend: ...

    def unsupported(self, schema: Any) -> Unsupported | None: ...
