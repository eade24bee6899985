"""Sharding plans: every rank's slices put back together give the whole model, and the
sharded LoRA deltas (S-LoRA) sum or join to the whole delta with no extra collective."""

from __future__ import annotations

import pytest
import torch
from enginecore_helpers import tiny_random_config
from loraplex.engine.config import EngineConfig
from loraplex.engine.cuda.random_weights import named_config
from loraplex.engine.model.loader import random_model
from loraplex.engine.parallel.plan import ShardingError, ShardPlan, shard_state_dict


def test_llama_70b_over_four_ranks_splits_heads_features_and_vocab() -> None:
    config = named_config("Llama-3.1-70B")
    plans = [ShardPlan.for_rank(config, r, 4) for r in range(4)]
    assert [(p.num_heads, p.head_start) for p in plans] == [(16, 0), (16, 16), (16, 32), (16, 48)]
    assert [(p.num_kv_heads, p.kv_head_start) for p in plans] == [(2, 0), (2, 2), (2, 4), (2, 6)]
    assert {p.intermediate_size for p in plans} == {7168}
    assert plans[3].vocab_start == 3 * 32064 and plans[3].vocab_per_rank * 4 == 128256
    # Each rank's query heads read only the KV heads it holds (8 query heads per KV head).
    for p in plans:
        groups = {h // 8 for h in range(p.head_start, p.head_start + p.num_heads)}
        assert groups == set(range(p.kv_head_start, p.kv_head_start + p.num_kv_heads))


def test_fewer_kv_heads_than_ranks_replicates_the_kv_head_each_query_group_reads() -> None:
    config = tiny_random_config(num_attention_heads=8, num_key_value_heads=2)
    plans = [ShardPlan.for_rank(config, r, 4) for r in range(4)]
    assert [(p.num_kv_heads, p.kv_head_start) for p in plans] == [(1, 0), (1, 0), (1, 1), (1, 1)]
    for p in plans:
        assert {h // 4 for h in range(p.head_start, p.head_start + p.num_heads)} == {p.kv_head_start}
    assert EngineConfig(tensor_parallel_size=4).bytes_per_block(config) * 2 == EngineConfig().bytes_per_block(config)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"num_attention_heads": 6, "num_key_value_heads": 6}, "attention heads"),
    ({"num_attention_heads": 12, "num_key_value_heads": 3}, "KV heads"),
    ({"intermediate_size": 130}, "intermediate size"),
])
def test_a_model_that_does_not_divide_is_refused(overrides: dict, message: str) -> None:
    with pytest.raises(ShardingError, match=message):
        ShardPlan.for_rank(tiny_random_config(**overrides), 0, 4)


def test_rank_shards_of_every_weight_join_back_to_the_whole_model() -> None:
    config = tiny_random_config(vocab_size=1001)  # not a multiple of the ranks: the last rank pads
    full = random_model(config, 128, seed=3)
    world = 2
    shards = [shard_state_dict(full, ShardPlan.for_rank(config, r, world)) for r in range(world)]
    for name, whole in full.named_parameters():
        parts = [s[name] for s in shards]
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            joined = torch.cat(parts)[: config.vocab_size]
            assert torch.cat(parts)[config.vocab_size :].abs().sum() == 0
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            joined = torch.cat(parts, dim=1)
        elif name.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
            # Merged slices: rank shards hold [q_r, k_r, v_r]; regroup slice by slice.
            linear = full.get_submodule(name.rpartition(".")[0])
            sizes = [(end - start) // world for _, start, end in linear.slices]
            joined = torch.cat([torch.cat([p.split(sizes)[i] for p in parts]) for i in range(len(sizes))])
        else:
            assert all(torch.equal(p, whole) for p in parts)
            continue
        assert torch.equal(joined, whole), name


def test_sharded_lora_deltas_need_no_collective_beyond_the_layer_all_reduce() -> None:
    config = tiny_random_config()
    generator = torch.Generator().manual_seed(0)
    x_hidden = torch.randn(5, config.hidden_size, generator=generator, dtype=torch.float64)
    x_inter = torch.randn(5, config.intermediate_size, generator=generator, dtype=torch.float64)
    rank = 4
    for world in (2, 4):
        plans = [ShardPlan.for_rank(config, r, world) for r in range(world)]
        # Column-parallel (gate): A whole, B by output rows; the rank outputs join.
        a = torch.randn(rank, config.hidden_size, generator=generator, dtype=torch.float64)
        b = torch.randn(config.intermediate_size, rank, generator=generator, dtype=torch.float64)
        parts = [x_hidden @ sa.T @ sb.T for sa, sb in (p.shard_lora("gate_proj", a, b) for p in plans)]
        torch.testing.assert_close(torch.cat(parts, dim=1), x_hidden @ a.T @ b.T)
        # Row-parallel (down): A by input columns, B whole; each rank's x is its feature slice and
        # the partial deltas sum, exactly as the base matmul's partial sums do in the all-reduce.
        a = torch.randn(rank, config.intermediate_size, generator=generator, dtype=torch.float64)
        b = torch.randn(config.hidden_size, rank, generator=generator, dtype=torch.float64)
        total = torch.zeros(5, config.hidden_size, dtype=torch.float64)
        for p in plans:
            start, end = p.in_columns("down_proj")
            sa, sb = p.shard_lora("down_proj", a, b)
            total += x_inter[:, start:end] @ sa.T @ sb.T
        torch.testing.assert_close(total, x_inter @ a.T @ b.T)
