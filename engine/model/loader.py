"""Build a model from a local Hugging Face folder (safetensors) or at random."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from loraplex.engine.config import ModelConfig
from loraplex.engine.model.layers import LoRALinear
from loraplex.engine.model.llama import LlamaForCausalLM, unfilled_model
from loraplex.engine.parallel.group import SINGLE_RANK, TensorParallelGroup
from loraplex.engine.parallel.plan import ShardPlan, shard_state_dict
from safetensors import safe_open

# HF projection name -> (our merged module, slice name inside it)
_MERGED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q_proj"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k_proj"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj", "o_proj"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate_proj"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up_proj"),
    "mlp.down_proj": ("mlp.down_proj", "down_proj"),
}
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def load_model(
    model_dir: str | Path, max_model_len: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
    tp: TensorParallelGroup = SINGLE_RANK,
) -> LlamaForCausalLM:
    """The model (or, with `tp` over several ranks, this rank's shard of it: each tensor is
    sliced as it is read, so no rank ever holds the whole model)."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    model = unfilled_model(config, max_model_len, tp, dtype, device)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    target, rows = _target_of(name, model)
                    if target is None:
                        continue
                    param = params[target]
                    tensor = _shard_of(name, handle.get_tensor(name), model.plan).to(dtype)
                    if rows is None:
                        param.copy_(tensor)
                    else:
                        param[rows[0] : rows[1]].copy_(tensor)
                    seen.add(target)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        seen.add("lm_head.weight")
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"{model_dir}: weights missing from the checkpoint: {missing[:5]}")
    return model.eval()


def _shard_of(hf_name: str, tensor: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    if plan.world_size == 1:
        return tensor
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return plan.shard_vocab(tensor)
    match = _LAYER_KEY.match(hf_name)
    module = match.group(2) if match else ""
    if module in _MERGED:
        return plan.shard_weight(module.rpartition(".")[2], tensor)
    return tensor  # norms: every rank holds them whole


def _target_of(hf_name: str, model: LlamaForCausalLM) -> tuple[str | None, tuple[int, int] | None]:
    if hf_name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if hf_name == "model.norm.weight":
        return "norm.weight", None
    if hf_name == "lm_head.weight":
        return (None, None) if model.config.tie_word_embeddings else ("lm_head.weight", None)
    match = _LAYER_KEY.match(hf_name)
    if match is None:
        return None, None  # e.g. rotary inv_freq buffers in old checkpoints
    layer, module, kind = match.groups()
    if module in _MERGED:
        ours, slice_name = _MERGED[module]
        linear = model.layers[int(layer)].get_submodule(ours)
        if not isinstance(linear, LoRALinear):
            raise TypeError(f"{ours} of layer {layer} is a {type(linear).__name__}, not a merged LoRALinear")
        return f"layers.{layer}.{ours}.{kind}", linear.slice_of(slice_name)
    return f"layers.{layer}.{module}.{kind}", None


def random_model(
    config: ModelConfig, max_model_len: int, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu",
    tp: TensorParallelGroup = SINGLE_RANK,
) -> LlamaForCausalLM:
    """Random weights (normal, std 0.02; norms at one) for tests and benchmarks.

    With `tp` over several ranks: the whole model is drawn (the same weights for every
    tensor-parallel size) and this rank keeps its shard."""
    generator = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config, max_model_len)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    if tp.is_parallel:
        model = shard_model(model, tp)
    return model.to(device=device, dtype=dtype).eval()


def shard_model(full: LlamaForCausalLM, tp: TensorParallelGroup) -> LlamaForCausalLM:
    """This rank's shard of a whole model (same device and dtype)."""
    weight = next(full.parameters())  # its dtype and device are the whole model's
    # the whole model's rotary tables, shared (its max_model_len is not known here)
    model = unfilled_model(full.config, full.rotary.cos.shape[0], tp, weight.dtype, weight.device, full.rotary)
    if full.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, tensor in shard_state_dict(full, model.plan).items():
            params[name].copy_(tensor)
    return model.eval()
