"""The per-step context passed explicitly through the model's forward.

There is no global mutable context: the runner builds one `StepContext`
per step and hands it to `model(input_ids, positions, ctx)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch


class LoRAStepContext(Protocol):
    """What the LoRA engineer's step object provides (see `LoRALinear`)."""

    def apply(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        layer_index: int,
        slices: tuple[tuple[str, int, int], ...],
    ) -> None: ...


class AdapterRow(Protocol):
    """A row of the step as the LoRA builder sees it: a sequence, or a padded graph row (no adapter)."""

    @property
    def adapter_id(self) -> str | None: ...


AdapterRows = Sequence[AdapterRow]


class LoRAStepBuilder(Protocol):
    """What the runner needs of the LoRA manager (engine/lora/manager.py) to build a step's LoRA context."""

    def build(self, seqs_in_batch_order: AdapterRows, token_counts: list[int]) -> LoRAStepContext | None:
        """Given the step's rows (batch order) and tokens per row; None when no row has an adapter."""

    def token_slots(self, seqs_in_batch_order: AdapterRows, token_counts: list[int]) -> list[int] | None:
        """Each token's adapter slot (-1: base); None when no token has an adapter."""

    def batch_of(self, token_slots: list[int], signature: str | None = None) -> LoRAStepContext:
        """The context of tokens whose slots are known (tensor parallelism sends them to the workers);
        `signature`: with that set of linears' slot stacks rather than the adapted ones (a graph's capture)."""


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's chunk of new tokens, rows [start, end) of the step."""

    start: int
    end: int
    # Block ids of the whole context (cached prefix + this chunk) and the causal mask over
    # those blocks' slots (additive: 0 or -inf); both None when the chunk is its whole context.
    context_blocks: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass(slots=True)
class DecodeBucket:
    """Decode rows [start, end) of the step (sorted by context length), padded to this bucket's longest."""

    start: int
    end: int
    blocks: torch.Tensor                      # [(end - start) * max_blocks] block ids to gather, row-major
    mask: torch.Tensor | None = None          # [end - start, 1, 1, max_blocks * bs] additive; None: no padding


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor                # [T] flat cache slot each new token's K/V goes to
    num_decode_tokens: int = 0                # decodes are rows [0, num_decode_tokens)
    block_size: int = 16
    # Decode rows grouped by context length, one masked SDPA each (less padding than one batch)
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)


class StepAttentionMetadata(Protocol):
    """What every backend's metadata has; the rest is the backend's own (`StepContext.attention_as`)."""

    slot_mapping: torch.Tensor
    block_size: int


Metadata = TypeVar("Metadata", bound=StepAttentionMetadata)


class AttentionBackend(Protocol):
    """One layer's rotary + K/V cache write + paged attention (registry: `engine.attention`).

    q: [T, heads, D], k/v: [T, kv_heads, D] before rotary; `ctx.attention` is the metadata
    the runner built for this backend. Returns [T, heads * D].
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        ctx: StepContext,
        scale: float,
    ) -> torch.Tensor: ...


@dataclass(slots=True)
class StepContext:
    attention: StepAttentionMetadata          # the backend's metadata (AttentionMetadata for "torch")
    cos: torch.Tensor                         # [T, 1, head_dim]
    sin: torch.Tensor
    backend: AttentionBackend
    lora: LoRAStepContext | None = None

    def attention_as(self, kind: type[Metadata]) -> Metadata:
        """The metadata as the backend's own kind; a runner that paired a backend with another
        backend's metadata is a programming error, caught here rather than deep in a kernel."""
        if not isinstance(self.attention, kind):
            raise TypeError(f"{self.backend!r} needs {kind.__name__}, got {type(self.attention).__name__}")
        return self.attention
