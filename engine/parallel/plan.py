"""Which slice of every weight a tensor-parallel rank holds (Megatron-style; pure arithmetic).

- column-parallel (q, k, v, gate, up): a rank holds a contiguous range of output rows; its
  activations come out sharded by heads / intermediate features and need no collective;
- row-parallel (o, down): a rank holds the matching range of input columns; each rank's
  product is a partial sum, added across ranks by one all-reduce;
- vocab-parallel (embedding, LM head): a rank holds ceil(vocab / ranks) rows, the last rank's
  padded with zeros; the embedding all-reduces, the LM head all-gathers logits;
- KV heads split across ranks, or, with fewer KV heads than ranks, each replicated on
  `ranks / kv_heads` ranks (every rank keeps the KV head its query heads read).

LoRA follows the same split (S-LoRA): for a column-parallel layer B is sharded by output
rows and A is whole; for a row-parallel layer A is sharded by input columns and B is whole,
so each rank's delta is a partial sum that rides the layer's own all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from loraplex.engine.config import ModelConfig

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


class ShardingError(ValueError):
    """The model cannot be split over this many ranks."""


@dataclass(frozen=True, slots=True)
class ShardPlan:
    rank: int
    world_size: int
    head_dim: int
    num_heads: int          # query heads on this rank
    head_start: int
    num_kv_heads: int       # KV heads on this rank
    kv_head_start: int
    intermediate_size: int  # MLP features on this rank
    vocab_size: int         # the whole vocabulary
    vocab_per_rank: int

    @classmethod
    def for_rank(cls, config: ModelConfig, rank: int, world_size: int) -> ShardPlan:
        check_divisible(config, world_size)
        heads, kv = config.num_attention_heads // world_size, config.num_key_value_heads
        if kv >= world_size:
            kv_local, kv_start = kv // world_size, rank * (kv // world_size)
        else:
            kv_local, kv_start = 1, rank // (world_size // kv)
        inter = config.intermediate_size // world_size
        return cls(rank, world_size, config.head_dim, heads, rank * heads, kv_local, kv_start, inter,
                   config.vocab_size, -(-config.vocab_size // world_size))

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def out_rows(self, module_name: str) -> tuple[int, int]:
        """Rows of a column-parallel module's [out, in] weight this rank holds."""
        if module_name == "q_proj":
            return self.head_start * self.head_dim, (self.head_start + self.num_heads) * self.head_dim
        if module_name in ("k_proj", "v_proj"):
            return self.kv_head_start * self.head_dim, (self.kv_head_start + self.num_kv_heads) * self.head_dim
        if module_name in ("gate_proj", "up_proj"):
            return self.rank * self.intermediate_size, (self.rank + 1) * self.intermediate_size
        raise KeyError(module_name)

    def in_columns(self, module_name: str) -> tuple[int, int]:
        """Columns of a row-parallel module's [out, in] weight this rank holds."""
        if module_name == "o_proj":
            return self.head_start * self.head_dim, (self.head_start + self.num_heads) * self.head_dim
        if module_name == "down_proj":
            return self.rank * self.intermediate_size, (self.rank + 1) * self.intermediate_size
        raise KeyError(module_name)

    def shard_weight(self, module_name: str, weight: torch.Tensor) -> torch.Tensor:
        """A projection's whole weight [out, in] (or bias [out]) -> this rank's part."""
        if module_name in COLUMN_PARALLEL:
            start, end = self.out_rows(module_name)
            return weight[start:end]
        if module_name in ROW_PARALLEL:
            if weight.dim() == 1:
                raise ShardingError(f"a bias on the row-parallel {module_name} is not supported")
            start, end = self.in_columns(module_name)
            return weight[:, start:end]
        raise KeyError(module_name)

    def shard_lora(self, module_name: str, lora_a: torch.Tensor, lora_b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter module's A [r, in] and B [out, r] -> this rank's (A, B)."""
        if self.world_size == 1:
            return lora_a, lora_b
        if module_name in COLUMN_PARALLEL:
            start, end = self.out_rows(module_name)
            return lora_a, lora_b[start:end]
        start, end = self.in_columns(module_name)
        return lora_a[:, start:end], lora_b

    def shard_vocab(self, weight: torch.Tensor) -> torch.Tensor:
        """Embedding / LM head [vocab, hidden] -> this rank's rows, zero padded to `vocab_per_rank`."""
        rows = weight[self.vocab_start : self.vocab_start + self.vocab_per_rank]
        if rows.shape[0] == self.vocab_per_rank:
            return rows
        padded = weight.new_zeros((self.vocab_per_rank, *weight.shape[1:]))
        padded[: rows.shape[0]] = rows
        return padded


def check_divisible(config: ModelConfig, world_size: int) -> None:
    if world_size < 1:
        raise ShardingError(f"tensor_parallel_size must be at least 1, got {world_size}")
    kv = config.num_key_value_heads
    problems = []
    if config.num_attention_heads % world_size:
        problems.append(f"{config.num_attention_heads} attention heads")
    if kv % world_size and world_size % kv:
        problems.append(f"{kv} KV heads (neither divides the other)")
    if config.intermediate_size % world_size:
        problems.append(f"intermediate size {config.intermediate_size}")
    if problems:
        raise ShardingError(f"cannot split over {world_size} ranks: {', '.join(problems)}")


def shard_state_dict(full: torch.nn.Module, plan: ShardPlan) -> dict[str, torch.Tensor]:
    """A whole model's parameters -> the rank's, named as in the rank's (sharded) model.

    Merged projections (q/k/v, gate/up) are split slice by slice, then re-joined in slice order.
    """
    from loraplex.engine.model.layers import LoRALinear

    out: dict[str, torch.Tensor] = {}
    merged = {name: m for name, m in full.named_modules() if isinstance(m, LoRALinear)}
    for name, param in full.named_parameters(remove_duplicate=False):
        owner = name.rpartition(".")[0]
        if owner in merged:
            linear = merged[owner]
            parts = [plan.shard_weight(slice_name, param[start:end]) for slice_name, start, end in linear.slices]
            out[name] = torch.cat(parts, dim=0)
        elif owner in ("embed_tokens", "lm_head"):
            out[name] = plan.shard_vocab(param)
        else:
            out[name] = param
    return out
