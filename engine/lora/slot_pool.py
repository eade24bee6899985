"""The fixed pool of device slots: one stacked A/B buffer per LoRA-ready linear, indexed by slot.

Every `LoRALinear` of the model (merged q/k/v, o, merged gate/up, down) gets a
`LoRAStack` with `max_loras` slots of rank up to `max_lora_rank`; writing an
adapter into slot s fills, for each layer and slice, the slice's A/B (zero
padded past its rank) and scaling, and marks slices the adapter does not
touch as rank 0, which the kernels skip.

The kernels skip a rank-0 slice only once launched, and a decode step's LoRA kernels are latency-bound
(~3-5 us a launch whatever they compute), so a step's LoRA batch carries only the stacks of the linears some
resident adapter adapts (`adapted_stacks`): with PEFT's default targets (q_proj, v_proj) that is one linear in
four. Which linears those are is `adapted_signature`, a CUDA graph's key beside its shape.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch
from loraplex.engine.interfaces import AdapterWeights, LoRAModuleWeights
from loraplex.engine.kernels.lora_metadata import LoRAMetadata
from loraplex.engine.kernels.lora_weights import LoRAStack
from loraplex.engine.model.layers import LoRALinear
from torch import nn

StackKey = tuple[int, tuple[tuple[str, int, int], ...]]  # (layer_index, the linear's slices)
EVERY_LINEAR = "all"  # the signature of a batch with every LoRA-ready linear's stack
# Sets of adapted linears a pool names over its life, "all" among them: each new one captures its CUDA graphs on
# first use (one stall of the engine's loop, every shape at once), so tenants uploading adapters of ever new target sets
# cannot make it capture without end; past the cap a new set runs on the graphs of every linear.
MAX_SIGNATURES = 4


def linear_kind(key: StackKey) -> str:
    """The linear a stack belongs to, the same in every layer: its slices' module names ("q_proj+k_proj+v_proj")."""
    return "+".join(name for name, _, _ in key[1])


class SliceEntry(NamedTuple):
    """One adapted slice of one slot, as plain Python (the CPU path reads no tensors to find it)."""

    slice_index: int  # which of the stack's slices (`index` would shadow tuple.index)
    rank: int
    out_start: int
    out_end: int
    scaling: float
    col_start: int = 0  # this slice's columns in the slot's concatenated shrink (see `shrink_a`)
    col_end: int = 0


class AdapterShapeError(ValueError):
    """The adapter does not fit this model or the pool's limits (raised before any slot is touched)."""


class LoRASlotPool:
    def __init__(
        self, model: nn.Module, *, max_loras: int, max_lora_rank: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.device = torch.device(device)
        # adapter mix (each token's slot) -> the kernels' metadata for it (engine/lora/step.py)
        self.metadata_cache: OrderedDict[tuple[int, ...], LoRAMetadata] = OrderedDict()
        self.stacks: dict[StackKey, LoRAStack] = {}
        # stack key -> slot -> the slices that slot adapts (absent: the slot adapts nothing there)
        self.slot_slices: dict[StackKey, dict[int, list[SliceEntry]]] = {}
        # stack key -> slot -> the A of every slice it adapts, stacked [sum of ranks, in_features]: on the
        # CPU one matmul shrinks all slices of a merged linear (q/k/v, gate/up) at once
        self.shrink_a: dict[StackKey, dict[int, torch.Tensor]] = {}
        # (layer, module name) -> (stack key, slice index), to place an adapter's modules
        self._placement: dict[tuple[int, str], tuple[StackKey, int]] = {}
        # This rank's part of an adapter module (tensor parallelism; whole with one rank)
        self.plan = getattr(model, "plan", None)
        for module in model.modules():
            if not isinstance(module, LoRALinear):
                continue
            key: StackKey = (module.layer_index, module.slices)
            out_sizes = tuple(end - start for _, start, end in module.slices)
            self.stacks[key] = LoRAStack.allocate(
                num_slots=max_loras, max_rank=max_lora_rank, in_features=module.in_features,
                out_sizes=out_sizes, dtype=dtype, device=self.device,
            )
            self.slot_slices[key] = {}
            self.shrink_a[key] = {}
            for index, (name, _, _) in enumerate(module.slices):
                self._placement[(module.layer_index, name)] = (key, index)
        # The stacks of the linears (in every layer) that some slot adapts, and which linears those are: a
        # linear adapted in one layer keeps its stacks in all (signatures stay few: one per set of targets)
        self.adapted_stacks: dict[StackKey, LoRAStack] = {}
        self.adapted_signature = ""
        self._signatures_named: set[str] = {EVERY_LINEAR}

    def stacks_for(self, signature: str) -> dict[StackKey, LoRAStack]:
        """The stacks a batch of this signature carries (`EVERY_LINEAR`: all of them)."""
        if signature == EVERY_LINEAR:
            return self.stacks
        kinds = set(signature.split(",")) if signature else set()
        return {key: stack for key, stack in self.stacks.items() if linear_kind(key) in kinds}

    def _refresh_adapted(self) -> None:
        signature = self._named_signature({linear_kind(key) for key, table in self.slot_slices.items() if table})
        self.adapted_signature = signature
        self.adapted_stacks = self.stacks_for(signature)

    def signature_for_targets(self, module_names: set[str]) -> str:
        """The signature resident adapters on these modules (PEFT's target names, e.g. {"q_proj", "v_proj"}) make,
        named now (it counts toward MAX_SIGNATURES), so their graphs can be captured before any is loaded."""
        return self._named_signature({linear_kind(key) for key in self.stacks
                                      if any(name in module_names for name, _, _ in key[1])})

    def _named_signature(self, kinds: set[str]) -> str:
        every = {linear_kind(key) for key in self.stacks}
        signature = EVERY_LINEAR if kinds == every else ",".join(sorted(kinds))
        if signature and signature not in self._signatures_named:  # "": no slot adapts anything, no graph needed
            if len(self._signatures_named) >= MAX_SIGNATURES:
                signature = EVERY_LINEAR
            self._signatures_named.add(signature)
        return signature

    def shard(self, name: str, w: LoRAModuleWeights) -> LoRAModuleWeights:
        """An adapter module as this rank holds it (S-LoRA: B by output rows for column-parallel
        layers, A by input columns for row-parallel ones)."""
        if self.plan is None or self.plan.world_size == 1:
            return w
        lora_a, lora_b = self.plan.shard_lora(name, w.lora_a, w.lora_b)
        return LoRAModuleWeights(lora_a, lora_b, w.scaling)

    def check(self, weights: AdapterWeights) -> None:
        for (layer, name), whole in weights.modules.items():
            placed = self._placement.get((layer, name))
            if placed is None:
                raise AdapterShapeError(f"adapter {weights.adapter_id}: the model has no layer {layer} {name}")
            stack, index = self.stacks[placed[0]], placed[1]
            rank = whole.lora_a.shape[0]
            if rank > self.max_lora_rank:
                raise AdapterShapeError(
                    f"adapter {weights.adapter_id}: layer {layer} {name} has rank {rank} > max_lora_rank "
                    f"{self.max_lora_rank}"
                )
            try:
                w = self.shard(name, whole)
            except Exception as exc:
                raise AdapterShapeError(f"adapter {weights.adapter_id}: layer {layer} {name}: {exc}") from exc
            want_a = (rank, stack.in_features)
            want_b = (stack.out_sizes[index], rank)
            if tuple(w.lora_a.shape) != want_a or tuple(w.lora_b.shape) != want_b:
                raise AdapterShapeError(
                    f"adapter {weights.adapter_id}: layer {layer} {name} has A {list(w.lora_a.shape)} / "
                    f"B {list(w.lora_b.shape)}, expected {list(want_a)} / {list(want_b)}"
                )

    def write(self, slot: int, weights: AdapterWeights) -> None:
        """Fill `slot` with the adapter; every slice it does not adapt becomes rank 0."""
        self.check(weights)
        self.clear(slot)
        for (layer, name), whole in weights.modules.items():
            key, index = self._placement[(layer, name)]
            stack = self.stacks[key]
            w = self.shard(name, whole)
            stack.set_slot(
                slot, index, w.lora_a.to(self.device, non_blocking=True), w.lora_b.to(self.device, non_blocking=True),
                w.scaling,
            )
            start = stack.out_offset(index)
            entry = SliceEntry(index, w.lora_a.shape[0], start, start + stack.out_sizes[index], float(w.scaling))
            self.slot_slices[key].setdefault(slot, []).append(entry)
        if self.device.type == "cpu":
            for key, table in self.slot_slices.items():
                if slot in table:
                    self._stack_shrink(key, slot)
        self._refresh_adapted()

    def _stack_shrink(self, key: StackKey, slot: int) -> None:
        entries, placed, column = sorted(self.slot_slices[key][slot]), [], 0
        for e in entries:
            placed.append(e._replace(col_start=column, col_end=column + e.rank))
            column += e.rank
        self.slot_slices[key][slot] = placed
        stack = self.stacks[key]
        self.shrink_a[key][slot] = torch.cat([stack.lora_a[slot, e.slice_index, : e.rank] for e in placed]).contiguous()

    def clear(self, slot: int) -> None:
        for key, stack in self.stacks.items():
            stack.clear_slot(slot)
            self.slot_slices[key].pop(slot, None)
            self.shrink_a[key].pop(slot, None)
        self._refresh_adapted()
