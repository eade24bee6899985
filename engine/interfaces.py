"""The small interfaces the engine calls into other domains through.

The engine imports nothing from grammar/, adapters/ or sessions/; those
packages provide objects satisfying these protocols, and the platform wires
them in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from loraplex.engine.protocol import ReasoningMarkers

if TYPE_CHECKING:  # annotations only: the supervisor and the batch worker import these protocols without torch
    import torch


class GrammarMatcher(Protocol):
    """One choice's position in a grammar, advanced token by token."""

    def accept_token(self, token_id: int) -> bool:
        """Advance; False if the token is not allowed (the engine then ends the choice with an error)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits for the next step into `bitmask[row]`.

        `bitmask` is int32 of shape [batch, ceil(vocab_size / 32)], bit-packed
        as xgrammar packs it (bit j of word i allows token 32*i + j).
        """

    def is_terminated(self) -> bool:
        """True once the grammar is complete: the choice finishes with `stop`."""


@runtime_checkable
class BudgetedGrammarMatcher(Protocol):
    """A matcher that knows the choice's token budget: near it, it forces the shortest close, and it
    names the tokens the grammar forces next so the engine can append them without sampling."""

    def set_token_budget(self, max_tokens: int, phase: int = 0) -> None:
        """The choice's most output tokens; `phase` (its index) lets choices spread their planning over steps."""

    def forced_token_ids(self) -> list[int]:
        """Tokens the mask will force next, in order; appending them at once (jump-forward) gives the
        same output as sampling them one step at a time."""

    def closed_by_budget(self) -> bool:
        """True when the budget forced the close: the choice then finishes with `length`."""


class CompiledGrammar(Protocol):
    def new_matcher(self) -> GrammarMatcher: ...


@dataclass(slots=True)
class LoRAModuleWeights:
    """One adapted module of one layer: y += scaling * (x @ A.T) @ B.T."""

    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank]
    scaling: float


@dataclass(slots=True)
class AdapterWeights:
    adapter_id: str
    rank: int
    # (layer_index, module_name) -> weights; module_name in q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
    modules: dict[tuple[int, str], LoRAModuleWeights]


class AdapterSource(Protocol):
    """Where the engine gets an adapter's host-memory weights (adapters/ implements it)."""

    def load(self, adapter_id: str) -> AdapterWeights:
        """Blocking; called off the engine loop. Raises KeyError for an unknown adapter."""


class GrammarCodec(Protocol):
    """How a request's grammar crosses to the engine-core process (grammar/ provides it, the platform wires it).

    The API server compiled the grammar already (to refuse a bad one with a 400); the core rebuilds
    it from the text, from a cache keyed by that text.
    """

    def encode(self, grammar: CompiledGrammar) -> str: ...

    def decode(self, text: str, reasoning: ReasoningMarkers | None) -> CompiledGrammar:
        """`reasoning`: the request's markers, when its grammar is gated behind the think block."""


class AdapterSourceCodec(Protocol):
    """How an adapter source crosses to the engine-core process: a source holds open files and connections,
    which do not cross, so the client writes where its adapters are and the core opens that place itself."""

    def encode(self, source: AdapterSource) -> str: ...

    def decode(self, text: str) -> AdapterSource: ...
