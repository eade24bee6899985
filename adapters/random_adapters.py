"""Write PEFT-format adapters with random non-zero A and B, for tests and benchmarks.

The files look exactly like PEFT's `save_pretrained` output (same config keys,
same tensor names), so the reader is exercised on the real format without
training.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from loraplex.adapters.base_model import BaseModelSpec
from safetensors.torch import save_file


def peft_config(
    *, r: int, alpha: float, targets: list[str] | str, base: str, use_rslora: bool = False,
    rank_pattern: dict | None = None, alpha_pattern: dict | None = None,
) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": r,
        "lora_alpha": alpha,
        "use_rslora": use_rslora,
        "target_modules": targets,
        "rank_pattern": rank_pattern or {},
        "alpha_pattern": alpha_pattern or {},
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "inference_mode": True,
    }


def tensor_name(layer: int, module: str, which: str) -> str:
    block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{block}.{module}.lora_{which}.weight"


def write_random_adapter(
    folder: Path,
    spec: BaseModelSpec,
    *,
    r: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    rank_pattern: dict[str, int] | None = None,
    use_rslora: bool = False,
    seed: int = 0,
    b_scale: float = 0.05,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Create `folder` with adapter_config.json + adapter_model.safetensors; B is non-zero."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for module in targets:
            rank = (rank_pattern or {}).get(module, r)
            in_f, out_f = spec.module_shapes[module]
            a = torch.randn(rank, in_f, generator=generator) / in_f**0.5
            b = torch.randn(out_f, rank, generator=generator) * b_scale
            tensors[tensor_name(layer, module, "A")] = a.to(dtype).contiguous()
            tensors[tensor_name(layer, module, "B")] = b.to(dtype).contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = peft_config(
        r=r, alpha=alpha, targets=list(targets), base=spec.name, use_rslora=use_rslora, rank_pattern=rank_pattern
    )
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder
