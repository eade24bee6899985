"""Host values onto the logits' device without making the host wait for the GPU."""

from __future__ import annotations

from typing import Any

import torch


def to_device(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A few host values as a tensor on `device`. To a GPU through pinned memory without blocking: a copy
    from pageable memory waits for the stream, i.e. for the forward still running, and a draw used to make
    four such copies a step, each a wait the host could not use."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
