"""Random bf16 models of real shapes, built on the GPU (nothing is downloaded there).

`named_config("Llama-3.1-8B")` gives the published architecture; `random_device_model`
allocates on the meta device and draws every weight directly on the target device, so an 8B
model needs neither host memory nor a host-to-device copy. `SyntheticTokenizer` stands in for
the real tokenizer where only ids matter (the engine's detokenizer still runs on every token).
"""

from __future__ import annotations

import zlib

import torch
from loraplex.engine.config import ModelConfig
from loraplex.engine.interfaces import AdapterWeights, LoRAModuleWeights
from loraplex.engine.model.llama import LlamaForCausalLM, unfilled_model
from loraplex.engine.parallel.group import SINGLE_RANK, TensorParallelGroup

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

NAMED_CONFIGS: dict[str, dict] = {
    "Llama-3.2-1B": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0}, "tie_word_embeddings": True,
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "Llama-3.1-70B": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "Qwen2.5-7B": {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "Llama-3.1-8B": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
}


def named_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(NAMED_CONFIGS[name])


@torch.no_grad()
def random_device_model(
    config: ModelConfig, max_model_len: int, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
    seed: int = 0, std: float = 0.02, tp: TensorParallelGroup = SINGLE_RANK,
) -> LlamaForCausalLM:
    """With `tp` over several ranks: this rank's shard shapes, drawn from `seed` alone."""
    model = unfilled_model(config, max_model_len, tp, dtype, device)
    if config.tie_word_embeddings:  # each module was given its own tensor
        model.lm_head.weight = model.embed_tokens.weight
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)
    return model.eval()


class SyntheticTokenizer:
    """Ids -> one printable character each; enough for the engine's output path."""

    eos_token_id = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x4E00 + i % 20000) for i in ids)


class RandomAdapterSource:
    """An `AdapterSource` of random LoRA adapters on every projection, seeded by the adapter id."""

    MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, config: ModelConfig, rank: int, *, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", std: float = 0.05, alpha: float = 32.0) -> None:
        self.config, self.rank, self.dtype, self.device = config, rank, dtype, device
        self.std, self.scaling = std, alpha / rank

    def shapes(self) -> dict[str, tuple[int, int]]:
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        h, i = c.hidden_size, c.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def num_bytes(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        per_layer = sum(self.rank * (fan_in + fan_out) for fan_in, fan_out in self.shapes().values())
        return per_layer * self.config.num_hidden_layers * element

    def load(self, adapter_id: str) -> AdapterWeights:
        generator = torch.Generator(device=self.device).manual_seed(zlib.crc32(adapter_id.encode()))
        modules = {}
        for layer in range(self.config.num_hidden_layers):
            for name, (fan_in, fan_out) in self.shapes().items():
                a = torch.randn(self.rank, fan_in, generator=generator, device=self.device) * self.std
                b = torch.randn(fan_out, self.rank, generator=generator, device=self.device) * self.std
                modules[(layer, name)] = LoRAModuleWeights(a.to(self.dtype), b.to(self.dtype), self.scaling)
        return AdapterWeights(adapter_id, self.rank, modules)
