"""The tensor-parallel group as the model sees it: a rank, a size, and the two collectives.

A layer holds a `TensorParallelGroup` and calls `all_reduce_` after a row-parallel matmul and
`all_gather_last` after the vocab-parallel LM head. With one rank both are no-ops, so the
single-device model runs exactly the code it always did.

Small all-reduces (a decode step's activations: batch x hidden, kilobytes to a megabyte) are
latency-bound: NCCL's ring with NVLink multicast off, as it must stay here, costs ~20 us each,
and a decode step has two per layer. `OneShotAllReduce` does them in one kernel over a
symmetric-memory buffer (CUDA IPC peer mappings, no multicast): each rank copies its part in,
the ranks meet at a barrier on signal pads, and every rank sums all peers' parts straight out
of their memory. Larger messages (prefill chunks) keep NCCL, which moves fewer bytes per rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Above this a one-shot all-reduce reads (ranks - 1) x the message from peers, more than a ring.
ONE_SHOT_MAX_BYTES = 2 * 1024 * 1024


class OneShotAllReduce:
    """One-kernel all-reduce for small CUDA messages through torch's symmetric memory."""

    def __init__(self, process_group: Any, dtype: torch.dtype, device: torch.device,
                 max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = process_group.group_name
        self.dtype = dtype
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)  # collective: every rank at once
        ops = torch.ops.symm_mem
        # The copy-in fused into the kernel where this torch has it; else a copy, then the kernel
        self.copy_op = getattr(ops, "one_shot_all_reduce_copy_out", None)
        self.op = ops.one_shot_all_reduce_out

    def accepts(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype == self.dtype and tensor.numel() <= self.buffer.numel() and tensor.is_contiguous()

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        flat, buffer = tensor.view(-1), self.buffer[: tensor.numel()]
        if self.copy_op is not None:
            self.copy_op(buffer, flat, "sum", self.group_name, flat)
        else:
            buffer.copy_(flat)
            self.op(buffer, "sum", self.group_name, flat)
        return tensor


_symmetric_memory_used = False


def symmetric_memory_reusable() -> bool:
    """Whether this process may set up symmetric memory for a new process group. Once per process:
    a later group reuses the first one's name, and the rendezvous then waited forever on the
    first group's state (seen on an H200 x4 machine: a second engine in one process hung at start).
    Rank 0 decides, before its workers start, so that every rank agrees."""
    return not _symmetric_memory_used


def one_shot_all_reduce(process_group: Any, dtype: torch.dtype, device: torch.device) -> OneShotAllReduce | None:
    """The one-shot all-reduce if this machine supports it and it sums correctly; else None
    (NCCL then carries every all-reduce). Collective: every rank calls it at the same point."""
    global _symmetric_memory_used
    _symmetric_memory_used = True
    try:
        fast = OneShotAllReduce(process_group, dtype, device)
        # Small integers: every partial sum is exact in any dtype, so both orders of summation agree
        # exactly (random bf16 values differ by a rounding between NCCL's ring and the one-shot sum).
        probe = torch.randint(-8, 9, (4096,), device=device).to(dtype)
        expected = probe.clone()
        dist.all_reduce(expected, group=process_group)
        got = fast(probe.clone())
        ok = torch.tensor([float(torch.equal(got, expected))], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=process_group)
        if ok.item() != 1.0:
            logger.warning("one-shot all-reduce disagrees with NCCL on this machine; using NCCL")
            return None
        return fast
    except Exception as exc:  # no symmetric memory here (driver, build, permissions): NCCL works everywhere
        logger.warning("one-shot all-reduce unavailable (%s: %s); using NCCL", type(exc).__name__, exc)
        return None


@dataclass(slots=True, frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    process_group: Any = None  # torch.distributed ProcessGroup; None with one rank
    one_shot: OneShotAllReduce | None = None  # small CUDA all-reduces; None: NCCL/gloo for all

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks in place (captured into CUDA graphs like any kernel)."""
        if self.world_size > 1:
            if self.one_shot is not None and tensor.is_cuda and self.one_shot.accepts(tensor):
                return self.one_shot(tensor)
            dist.all_reduce(tensor, group=self.process_group)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., world_size * n], rank r's columns at r * n."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts: tuple[torch.Tensor, ...] | list[torch.Tensor]
        if tensor.is_cuda:  # one NCCL call into one buffer
            gathered = tensor.new_empty((self.world_size, *tensor.shape))
            dist.all_gather_into_tensor(gathered, tensor, group=self.process_group)
            parts = gathered.unbind(0)
        else:  # gloo: the list form
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(parts, tensor, group=self.process_group)
        return torch.cat(parts, dim=-1)


SINGLE_RANK = TensorParallelGroup()
