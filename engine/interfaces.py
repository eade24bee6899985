"""The small interfaces the engine calls into other domains through.

The engine imports nothing from grammar/, adapters/ or sessions/; those
packages provide objects satisfying these protocols, and the platform wires
them in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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
