"""The tensor-parallel group as the model sees it: a rank, a size, and the two collectives.

A layer holds a `TensorParallelGroup` and calls `all_reduce_` after a row-parallel matmul and
`all_gather_last` after the vocab-parallel LM head. With one rank both are no-ops, so the
single-device model runs exactly the code it always did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(slots=True, frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    process_group: Any = None  # torch.distributed ProcessGroup; None with one rank

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks in place (captured into CUDA graphs like any kernel)."""
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.process_group)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., world_size * n], rank r's columns at r * n."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        if tensor.is_cuda:  # one NCCL call into one buffer
            gathered = tensor.new_empty((self.world_size, *tensor.shape))
            dist.all_gather_into_tensor(gathered, tensor, group=self.process_group)
            parts = gathered.unbind(0)
        else:  # gloo: the list form
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(parts, tensor, group=self.process_group)
        return torch.cat(parts, dim=-1)


SINGLE_RANK = TensorParallelGroup()
