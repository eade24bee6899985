"""The engine's slot pool and the CPU LoRA path, against the kernels' PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from loraplex.adapters.peft_format import read_peft_adapter
from loraplex.engine.config import ModelConfig
from loraplex.engine.kernels.lora_metadata import build_lora_metadata
from loraplex.engine.kernels.lora_reference import add_lora_ref
from loraplex.engine.lora.slot_pool import AdapterShapeError, LoRASlotPool
from loraplex.engine.lora.step import GroupedCpuLoRABatch
from loraplex.engine.model.loader import random_model
from random_adapters import TINY_HF_CONFIG, write_random_adapter
from waiting import wait_until


@pytest.fixture(scope="module")
def tiny_model():  # type: ignore[no-untyped-def]
    return random_model(ModelConfig.from_hf_dict(TINY_HF_CONFIG), 64, 0, torch.float32, "cpu")


@pytest.fixture
def pool(tiny_model, tmp_path, spec):  # type: ignore[no-untyped-def]
    pool = LoRASlotPool(tiny_model, max_loras=4, max_lora_rank=16, dtype=torch.float32, device="cpu")
    shapes = [(4, ("q_proj", "v_proj")), (16, ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")),
              (1, ("gate_proj", "up_proj"))]
    for slot, (rank, targets) in enumerate(shapes):
        folder = write_random_adapter(tmp_path / f"a{slot}", spec, r=rank, targets=targets, seed=slot, b_scale=0.5)
        pool.write(slot, read_peft_adapter(folder, f"a{slot}", spec))
    return pool


@pytest.mark.parametrize(
    "token_slots",
    [[-1, 0, 0, 1, 2, -1, 1], [0, 0, 0], [2, 2, -1, -1], [-1, -1, 1], [1, 0, 2, 1, 0, 2, -1, 1], [-1, -1]],
)
def test_grouped_cpu_path_matches_kernel_reference(pool, token_slots):  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(len(token_slots))
    batch = GroupedCpuLoRABatch.build(token_slots, pool)
    meta = build_lora_metadata(token_slots, max_loras=pool.max_loras, device="cpu")
    for (layer, slices), stack in pool.stacks.items():
        x = torch.randn(len(token_slots), stack.in_features, generator=generator)
        y = torch.randn(len(token_slots), stack.out_features, generator=generator)
        ours, ref = y.clone(), y.clone()
        batch.apply(x, ours, layer, slices)
        add_lora_ref(ref, x, stack, meta)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        base_rows = [i for i, s in enumerate(token_slots) if s < 0]
        assert torch.equal(ours[base_rows], y[base_rows])


def test_clear_and_limits(pool, tmp_path, spec):  # type: ignore[no-untyped-def]
    pool.clear(1)
    assert all(1 not in table for table in pool.slot_slices.values())
    assert all(int(stack.ranks[1].sum()) == 0 for stack in pool.stacks.values())
    big = write_random_adapter(tmp_path / "big", spec, r=32, targets=("q_proj",))
    with pytest.raises(AdapterShapeError, match="rank 32 > max_lora_rank 16"):
        pool.write(1, read_peft_adapter(big, "big", spec))


def test_kernel_batches_carry_only_the_adapted_linears(tiny_model, tmp_path, spec):  # type: ignore[no-untyped-def]
    """A kernel launch costs its latency even where every slot's slice is rank 0: a step's batch carries the
    stacks of the linears some resident adapter adapts, named by a signature (a CUDA graph's key)."""
    from loraplex.engine.lora.slot_pool import EVERY_LINEAR, linear_kind
    from loraplex.engine.lora.step import KernelLoRABatch

    pool = LoRASlotPool(tiny_model, max_loras=4, max_lora_rank=16, dtype=torch.float32, device="cpu")
    assert (pool.adapted_signature, pool.adapted_stacks) == ("", {})
    adapters = {name: read_peft_adapter(write_random_adapter(tmp_path / name, spec, r=4, targets=targets, seed=i),
                                        name, spec)
                for i, (name, targets) in enumerate([("qv", ("q_proj", "v_proj")), ("down", ("down_proj",)),
                                                     ("every", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"))])}
    pool.write(0, adapters["qv"])
    qkv = {key for key in pool.stacks if linear_kind(key) == "q_proj+k_proj+v_proj"}
    assert len(qkv) == TINY_HF_CONFIG["num_hidden_layers"]
    assert pool.adapted_signature == "q_proj+k_proj+v_proj" and set(pool.adapted_stacks) == qkv
    pool.write(1, adapters["down"])
    assert pool.adapted_signature == "down_proj,q_proj+k_proj+v_proj"
    batch = KernelLoRABatch.build([0, -1, 1], pool)
    assert batch.signature == pool.adapted_signature and set(batch.stacks) == set(pool.adapted_stacks)
    assert {linear_kind(key) for key in batch.stacks} == {"q_proj+k_proj+v_proj", "down_proj"}
    pool.write(2, adapters["every"])
    assert pool.adapted_signature == EVERY_LINEAR and pool.adapted_stacks == pool.stacks
    pool.clear(2)
    pool.clear(1)
    assert pool.adapted_signature == "q_proj+k_proj+v_proj"
    forced = KernelLoRABatch.build([0], pool, EVERY_LINEAR)  # a graph captured for every linear
    assert forced.signature == EVERY_LINEAR and forced.stacks == pool.stacks
    # Where the batch carries no stack, no LoRA work runs: the same output as a batch of every stack, whose
    # kernels find rank 0 there (the kernels' reference stands in for them on the CPU).
    meta = build_lora_metadata([0, -1, 0], max_loras=pool.max_loras, device="cpu")
    subset = KernelLoRABatch(meta, pool.adapted_stacks, add_lora_ref, pool.adapted_signature)
    every = KernelLoRABatch(meta, pool.stacks, add_lora_ref)
    generator = torch.Generator().manual_seed(0)
    for (layer, slices), stack in pool.stacks.items():
        x = torch.randn(3, stack.in_features, generator=generator)
        y = torch.randn(3, stack.out_features, generator=generator)
        ours, ref = y.clone(), y.clone()
        subset.apply(x, ours, layer, slices)
        every.apply(x, ref, layer, slices)
        assert torch.equal(ours, ref)
        assert torch.equal(ours, y) == ((layer, slices) not in qkv)


def test_new_sets_of_adapted_linears_past_the_cap_use_every_linear(tiny_model, tmp_path, spec):  # type: ignore[no-untyped-def]
    """Each new set of adapted linears captures CUDA graphs of its own on first use: a pool names at most
    MAX_SIGNATURES sets ("all" among them), and a set past them runs with every linear's stacks."""
    from loraplex.engine.lora.slot_pool import EVERY_LINEAR, MAX_SIGNATURES

    pool = LoRASlotPool(tiny_model, max_loras=1, max_lora_rank=16, dtype=torch.float32, device="cpu")
    seen = []
    for i, targets in enumerate([("q_proj",), ("o_proj",), ("down_proj",), ("gate_proj",), ("q_proj",)]):
        pool.write(0, read_peft_adapter(write_random_adapter(tmp_path / f"t{i}", spec, r=4, targets=targets, seed=i),
                                        f"t{i}", spec))
        seen.append((pool.adapted_signature, len(pool.adapted_stacks)))
    layers = TINY_HF_CONFIG["num_hidden_layers"]
    assert MAX_SIGNATURES == 4
    assert seen == [("q_proj+k_proj+v_proj", layers), ("o_proj", layers), ("down_proj", layers),
                    (EVERY_LINEAR, len(pool.stacks)), ("q_proj+k_proj+v_proj", layers)]
    pool.clear(0)
    assert (pool.adapted_signature, pool.adapted_stacks) == ("", {})


def test_the_signature_of_peft_default_targets_is_named_before_any_adapter_loads(tiny_model, tmp_path, spec):  # type: ignore[no-untyped-def]
    """A server captures the graphs of q_proj/v_proj adapters at start-up: the signature it names then is the one
    such an adapter makes once written, and it counts toward MAX_SIGNATURES like any other."""
    from loraplex.engine.lora.slot_pool import EVERY_LINEAR

    pool = LoRASlotPool(tiny_model, max_loras=1, max_lora_rank=16, dtype=torch.float32, device="cpu")
    assert pool.signature_for_targets({"q_proj", "v_proj"}) == "q_proj+k_proj+v_proj"
    assert pool.adapted_signature == "", "naming a signature loads nothing"
    pool.write(0, read_peft_adapter(write_random_adapter(tmp_path / "qv", spec, r=4, targets=("q_proj", "v_proj"),
                                                         seed=0), "qv", spec))
    assert pool.adapted_signature == "q_proj+k_proj+v_proj"
    assert pool.signature_for_targets({"o_proj"}) == "o_proj"
    assert pool.signature_for_targets({"down_proj"}) == "down_proj"
    assert pool.signature_for_targets({"gate_proj"}) == EVERY_LINEAR, "a fifth name would pass the cap"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_batch_on_gpu_matches_reference(tmp_path, spec, dtype):  # type: ignore[no-untyped-def]
    from loraplex.engine.lora.step import KernelLoRABatch

    model = random_model(ModelConfig.from_hf_dict(TINY_HF_CONFIG), 64, 0, dtype, "cuda")
    pool = LoRASlotPool(model, max_loras=4, max_lora_rank=16, dtype=dtype, device="cuda")
    for slot, (rank, targets) in enumerate([(4, ("q_proj", "v_proj")), (16, ("o_proj", "gate_proj", "down_proj"))]):
        folder = write_random_adapter(tmp_path / f"g{slot}", spec, r=rank, targets=targets, seed=slot, b_scale=0.5)
        pool.write(slot, read_peft_adapter(folder, f"g{slot}", spec, dtype=dtype))
    token_slots = [-1, 0, 1, 1, 0, -1, 1, 0, 0]
    batch = KernelLoRABatch.build(token_slots, pool)
    meta = build_lora_metadata(token_slots, max_loras=pool.max_loras, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    for (layer, slices), stack in pool.stacks.items():
        x = torch.randn(len(token_slots), stack.in_features, generator=generator, device="cuda").to(dtype)
        y = torch.randn(len(token_slots), stack.out_features, generator=generator, device="cuda").to(dtype)
        ours, ref = y.clone(), y.clone()
        batch.apply(x, ours, layer, slices)
        add_lora_ref(ref, x, stack, meta)
        torch.testing.assert_close(ours, ref, rtol=2e-2, atol=2e-2)


def test_manager_loads_in_background_and_reports_unservable_adapters(tiny_model, tmp_path, spec):  # type: ignore[no-untyped-def]
    from loraplex.adapters.source import FolderAdapterSource
    from loraplex.engine.lora.manager import LoRAManager

    folders = {
        "ok": write_random_adapter(tmp_path / "ok", spec, r=8, targets=("q_proj",)),
        "too-big": write_random_adapter(tmp_path / "too-big", spec, r=32, targets=("q_proj",)),
    }
    held: list[str] = []
    manager = LoRAManager(tiny_model, FolderAdapterSource(folders, spec, torch.float32), max_loras=1,
                          max_cpu_loras=2, max_lora_rank=16, dtype=torch.float32, device="cpu",
                          running_adapters=lambda: held)
    results: dict[str, bool] = {}

    def settled() -> bool:
        for name in folders:
            if name not in results and (manager.adapter_ready(name) or manager.load_error(name)):
                results[name] = manager.adapter_ready(name)
        return len(results) == len(folders)

    wait_until(settled, what=lambda: f"both adapters to load or fail: {results}")
    assert results == {"ok": True, "too-big": False}
    assert "rank 32 > max_lora_rank 16" in manager.load_error("too-big")
    assert manager.resident_adapter_ids == ["ok"]
    held.append("ok")  # a running request holds the only slot: another adapter must wait
    manager.host.source.folders["next"] = write_random_adapter(tmp_path / "next", spec, r=4, targets=("v_proj",))
    wait_until(lambda: manager.adapter_ready("next") is False and "next" in manager.host,
               what="the adapter to wait in host memory for a slot")
    assert manager.adapter_ready("next") is False
    held.clear()
    assert manager.adapter_ready("next") is True and manager.resident_adapter_ids == ["next"]
    manager.shutdown()
