"""Checks an adapter must pass before it is served, each failing with a specific reason.

Two stages: `check_upload` runs inside the upload request (cheap, structural:
sizes, JSON, the safetensors header's offsets) so hostile files get a 4xx at
once and nothing is stored; `validate_adapter` runs in the background task
(base-model fit, ranks, every tensor's shape, dtype conversion, NaN/Inf, a
smoke forward pass) and decides `ready` or `failed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from loraplex.adapters.archive import UploadLimits
from loraplex.adapters.base_model import BaseModelSpec
from loraplex.adapters.errors import AdapterRejectedError, UnsafeUploadError, UploadTooLargeError
from loraplex.adapters.peft_format import (
    CONFIG_NAME,
    PICKLE_SUFFIXES,
    WEIGHTS_NAME,
    PeftLoraConfig,
    load_checked_weights,
    parse_adapter_config,
)
from loraplex.adapters.safetensors_header import FLOAT_DTYPES, read_safetensors_header
from loraplex.engine.interfaces import AdapterWeights

# A delta this many times larger than its input would wreck the model's activations.
_MAX_DELTA_GAIN = 1e4


@dataclass(frozen=True, slots=True)
class AdapterSummary:
    rank: int
    alpha: float
    target_modules: list[str]
    num_modules: int
    size_bytes: int
    base_model: str | None


def check_upload(folder: Path, limits: UploadLimits) -> PeftLoraConfig:
    """Cheap structural checks on the two uploaded files; raises a 4xx error on the first problem."""
    for path in folder.iterdir():
        if path.name.endswith(PICKLE_SUFFIXES):
            raise UnsafeUploadError(f"{path.name}: pickled weights are refused; upload adapter_model.safetensors")
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    if not config_path.is_file() or not weights_path.is_file():
        raise AdapterRejectedError(f"an adapter needs both {CONFIG_NAME} and {WEIGHTS_NAME}")
    if config_path.stat().st_size > limits.max_config_bytes:
        raise UploadTooLargeError(f"{CONFIG_NAME} is larger than {limits.max_config_bytes} bytes")
    if weights_path.stat().st_size > limits.max_upload_bytes:
        raise UploadTooLargeError(f"{WEIGHTS_NAME} is larger than {limits.max_upload_bytes} bytes")
    config = parse_adapter_config(config_path.read_bytes())
    entries = read_safetensors_header(weights_path)
    for entry in entries.values():
        if entry.dtype not in FLOAT_DTYPES:
            raise AdapterRejectedError(f"tensor {entry.name!r} has dtype {entry.dtype}; LoRA weights must be floats")
    return config


def validate_adapter(
    folder: Path,
    adapter_id: str,
    spec: BaseModelSpec,
    *,
    max_rank: int,
    dtype: torch.dtype,
    limits: UploadLimits,
) -> tuple[AdapterWeights, AdapterSummary]:
    """The full check; returns the weights in the serving dtype and what the record should show."""
    config = check_upload(folder, limits)
    weights_path = folder / WEIGHTS_NAME
    for module_path, rank in [("*", config.r), *config.rank_pattern.items()]:
        if rank > max_rank:
            where = "r" if module_path == "*" else f"rank_pattern[{module_path!r}]"
            raise AdapterRejectedError(f"{where} = {rank} exceeds the maximum rank {max_rank}")
    weights = load_checked_weights(config, weights_path, adapter_id, spec, dtype=dtype)
    for (layer, module), w in weights.modules.items():
        for which, tensor in (("A", w.lora_a), ("B", w.lora_b)):
            if not torch.isfinite(tensor).all():
                raise AdapterRejectedError(
                    f"layer {layer} {module} lora_{which} holds NaN or Inf (after conversion to {dtype})"
                )
    _smoke_forward(weights, dtype)
    summary = AdapterSummary(
        rank=weights.rank,
        alpha=config.lora_alpha,
        target_modules=sorted({module for _, module in weights.modules}),
        num_modules=len(weights.modules),
        size_bytes=weights_path.stat().st_size,
        base_model=config.base_model_name_or_path,
    )
    return weights, summary


def _smoke_forward(weights: AdapterWeights, dtype: torch.dtype) -> None:
    """Push a small random batch through every module's delta of the first adapted layer."""
    generator = torch.Generator().manual_seed(0)
    first_layer = min(layer for layer, _ in weights.modules)
    for (layer, module), w in weights.modules.items():
        if layer != first_layer:
            continue
        x = torch.randn(2, w.lora_a.shape[1], generator=generator).to(dtype)
        delta = (x @ w.lora_a.T) @ w.lora_b.T * w.scaling
        if not torch.isfinite(delta).all():
            raise AdapterRejectedError(f"smoke forward: layer {layer} {module} produces NaN or Inf")
        gain = (delta.float().norm() / x.float().norm()).item()
        if gain > _MAX_DELTA_GAIN:
            raise AdapterRejectedError(
                f"smoke forward: layer {layer} {module} multiplies its input by {gain:.3g}; "
                "the adapter's weights are not plausible"
            )
