"""LoRAManager: which adapter sits in which device slot, and the per-step LoRA context.

`LLMEngine` builds it from its `adapters` argument (or `serve_adapters`) and wires it in twice:
  - `Scheduler(adapter_ready=manager.adapter_ready)`: a waiting request is
    admitted only once its adapter is in a device slot. If the weights are not
    in host memory yet, a background load starts and the request waits while
    the others run.
  - `ModelRunner(lora=manager)`: `build(seqs, token_counts)` maps every token
    of the step to its adapter's slot and returns a `LoRABatch` (or None when no
    token has an adapter, so base-only steps run no LoRA code at all).

Invariant: every running sequence's adapter is resident. A slot is reused only
when no running sequence holds its adapter, least recently used first; the
slot table is only changed on the engine thread (`adapter_ready`, `build`),
while other threads (the API's DELETE) queue evictions.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from loraplex.engine.context import AdapterRows
from loraplex.engine.interfaces import AdapterSource
from loraplex.engine.lora.host_cache import HostAdapterCache
from loraplex.engine.lora.slot_pool import AdapterShapeError, LoRASlotPool
from loraplex.engine.lora.step import LORA_BATCHES, LoRABatch
from torch import nn

RunningAdapters = Callable[[], Iterable[str | None]]


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        source: AdapterSource,
        *,
        max_loras: int,
        max_cpu_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
        load_retry_base_s: float = 1.0,
        load_retry_max_s: float = 60.0,
        mirror: Callable[[LoRASlotPool, dict[str, Any]], LoRASlotPool] | None = None,
        running_adapters: RunningAdapters = lambda: (),
        queued_adapters: RunningAdapters = lambda: (),
    ) -> None:
        """`running_adapters` / `queued_adapters`: the adapters of running sequences (they hold slots) and of
        queued ones (in use); the engine that owns this manager passes views of its scheduler."""
        self.pool = LoRASlotPool(model, max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype, device=device)
        if mirror is not None:  # tensor parallelism: every slot write and clear also reaches the workers
            self.pool = mirror(self.pool, dict(max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype))
        self.host = HostAdapterCache(source, max_cpu_loras=max_cpu_loras, retry_base_s=load_retry_base_s,
                                     retry_max_s=load_retry_max_s)
        self._build_batch = LORA_BATCHES[torch.device(device).type]
        self._slots: OrderedDict[str, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self._free = list(range(max_loras - 1, -1, -1))
        self._running = running_adapters
        self._queued = queued_adapters
        self._pending_evictions: set[str] = set()
        self._lock = threading.Lock()
        self.num_slot_writes = 0

    # ---- scheduler callback (engine thread) ---------------------------------------------
    def adapter_ready(self, adapter_id: str) -> bool:
        self._apply_evictions()
        if adapter_id in self._slots:
            self._slots.move_to_end(adapter_id)
            return True
        weights = self.host.get(adapter_id)
        if weights is None:
            self.host.request(adapter_id)
            return False
        try:
            self.pool.check(weights)
        except AdapterShapeError as exc:
            # Never raise into the scheduler (it would stop the engine loop); the request waits and
            # `load_error` tells why. Checked before a slot is taken, so no resident adapter is evicted.
            self.host.fail(adapter_id, exc)
            return False
        slot = self._take_slot()
        if slot is None:
            return False  # every slot is held by running requests; retry when one finishes
        try:
            self.pool.write(slot, weights)
        except Exception as exc:  # e.g. out of device memory: a transient failure, retried after a backoff
            self.pool.clear(slot)
            self._free.append(slot)
            self.host.fail(adapter_id, exc)
            return False
        self._slots[adapter_id] = slot
        self.num_slot_writes += 1
        return True

    def load_error(self, adapter_id: str) -> str | None:
        """Why an adapter's weights cannot be loaded now (the engine fails its waiting requests with it).

        A transient failure (I/O, memory) answers only until its backoff ends; then the next request
        loads again. A permanent one (the files do not fit this model) answers until the adapter is
        evicted or its files move (see `HostAdapterCache`).
        """
        return self.host.error(adapter_id)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        held = set(self._running())
        for victim in self._slots:  # least recently used first
            if victim not in held:
                slot = self._slots.pop(victim)
                self.pool.clear(slot)
                return slot
        return None

    # ---- per-step context (engine thread) --------------------------------------------------
    def build(self, seqs_in_batch_order: AdapterRows, token_counts: list[int]) -> LoRABatch | None:
        token_slots = self.token_slots(seqs_in_batch_order, token_counts)
        return None if token_slots is None else self.batch_of(token_slots)

    def token_slots(self, seqs_in_batch_order: AdapterRows, token_counts: list[int]) -> list[int] | None:
        """Each token's adapter slot (-1: base); None when no token has an adapter."""
        self._apply_evictions()
        if all(s.adapter_id is None for s in seqs_in_batch_order):
            return None
        token_slots: list[int] = []
        for seq, count in zip(seqs_in_batch_order, token_counts, strict=True):
            slot = -1 if seq.adapter_id is None else self._slot_of(seq.adapter_id)
            token_slots.extend([slot] * count)
        return token_slots or None

    def batch_of(self, token_slots: list[int], signature: str | None = None) -> LoRABatch:
        return self._build_batch(token_slots, self.pool, signature)

    def _slot_of(self, adapter_id: str) -> int:
        slot = self._slots.get(adapter_id)
        if slot is None and self.adapter_ready(adapter_id):
            slot = self._slots[adapter_id]
        if slot is None:
            raise RuntimeError(f"adapter {adapter_id} is scheduled but not resident")
        self._slots.move_to_end(adapter_id)
        return slot

    # ---- lifecycle (any thread) ----------------------------------------------------------
    def is_in_use(self, adapter_id: str) -> bool:
        """True while a request runs or waits with this adapter, or its weights are loading."""
        if self.host.is_loading(adapter_id) or adapter_id in set(self._running()):
            return True
        return adapter_id in set(self._queued())

    def evict(self, adapter_id: str) -> None:
        """Forget the adapter's host copy now and free its device slot on the engine's next step."""
        self.host.drop(adapter_id)
        with self._lock:
            self._pending_evictions.add(adapter_id)

    def _apply_evictions(self) -> None:
        if not self._pending_evictions:
            return
        with self._lock:
            pending, self._pending_evictions = self._pending_evictions, set()
        held = set(self._running())
        for adapter_id in pending:
            if adapter_id in held:
                continue  # still serving; the slot goes when the LRU reaches it
            slot = self._slots.pop(adapter_id, None)
            if slot is not None:
                self.pool.clear(slot)
                self._free.append(slot)

    @property
    def resident_adapter_ids(self) -> list[str]:
        return list(self._slots)

    def shutdown(self) -> None:
        """Stop loading adapters in the background (the engine that owns this manager calls it)."""
        self.host.shutdown()

