"""The Llama family (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm, SmolLM2).

Tokens of every sequence in a step are flattened into one `[T]` batch;
attention reads and writes the paged KV cache through the step context.
Built for one tensor-parallel rank (`tp`), every layer holds that rank's shard
(`engine/parallel/plan.py`); with one rank it is the whole model.
"""

from __future__ import annotations

import torch
from loraplex.engine.config import ModelConfig
from loraplex.engine.context import StepContext
from loraplex.engine.model.layers import (
    LoRALinear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from loraplex.engine.model.rope import rope_inv_freq
from loraplex.engine.parallel.group import SINGLE_RANK, TensorParallelGroup
from loraplex.engine.parallel.plan import ShardPlan
from torch import nn


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, plan: ShardPlan, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.num_heads = plan.num_heads
        self.num_kv_heads = plan.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = LoRALinear(
            config.hidden_size,
            [("q_proj", self.q_size), ("k_proj", self.kv_size), ("v_proj", self.kv_size)],
            layer_index,
            bias=config.qkv_bias,
            parallel="column",
            tp=tp,
        )
        self.o_proj = LoRALinear(self.q_size, [("o_proj", config.hidden_size)], layer_index, parallel="row", tp=tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, hidden: torch.Tensor, ctx: StepContext, kv_cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden, ctx)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (`config.qk_norm`)
            q = self.q_norm(q)
            k = self.k_norm(k)
        out = ctx.backend.forward(q, k, v, kv_cache, ctx, self.scale)  # rotary, cache write, attention
        return self.o_proj(out, ctx)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, plan: ShardPlan, tp: TensorParallelGroup) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}")
        self.intermediate = plan.intermediate_size
        self.gate_up_proj = LoRALinear(
            config.hidden_size,
            [("gate_proj", self.intermediate), ("up_proj", self.intermediate)],
            layer_index,
            parallel="column",
            tp=tp,
        )
        self.act = SiluAndMul()
        self.down_proj = LoRALinear(self.intermediate, [("down_proj", config.hidden_size)], layer_index,
                                    parallel="row", tp=tp)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x, ctx)), ctx)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, plan: ShardPlan, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index, plan, tp)
        self.mlp = MLP(config, layer_index, plan, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, ctx: StepContext, kv_cache: tuple[torch.Tensor, torch.Tensor],
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried separately: this layer's input is `hidden + residual`
        (just `hidden` for the first layer), its output the pair (MLP out, residual so far),
        so each residual add is fused into the RMSNorm that follows it."""
        if residual is None:
            residual = hidden
            x = self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm(hidden, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, ctx, kv_cache), residual)
        return self.mlp(x, ctx), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_model_len: int, tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.plan = ShardPlan.for_rank(config, tp.rank, tp.world_size)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.plan, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = VocabParallelHead(config.hidden_size, config.vocab_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        inv_freq, attention_scaling = rope_inv_freq(config, max_model_len)
        self.rotary = RotaryEmbedding(inv_freq, max(max_model_len, config.max_position_embeddings), attention_scaling)

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: StepContext,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """[T] token ids -> [T, hidden] final hidden states (normed)."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, ctx, kv_cache, residual)
        if residual is None:
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def unfilled_model(config: ModelConfig, max_model_len: int, tp: TensorParallelGroup, dtype: torch.dtype,
                   device: str | torch.device, rotary: RotaryEmbedding | None = None) -> LlamaForCausalLM:
    """The model's modules with uninitialised `dtype` tensors on `device`, to be filled by the caller (weights read
    from files, drawn at random, or a shard's slices). Built on the meta device, so no float32 copy is ever made;
    each tensor is then allocated with a plain `torch.empty`, because `Module.to_empty` goes through torch._refs,
    whose first use imports sympy (~0.5 s of CPU at every engine start). As with `to_empty`, a tensor two modules
    shared (tied embeddings) becomes two: the caller ties them again. The rotary tables, computed rather than
    read, are made here for real (or `rotary`'s are shared, a whole model's for its shards), never allocated
    empty first: a 131k-position model's pair is ~134 MB."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_model_len, tp)
    for module in model.modules():
        if module is model.rotary:
            continue
        for name, param in module._parameters.items():
            if param is not None:
                kind = dtype if param.is_floating_point() else param.dtype
                module._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=kind, device=device),
                                                        requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                kind = dtype if buffer.is_floating_point() else buffer.dtype
                module._buffers[name] = torch.empty(buffer.shape, dtype=kind, device=device)
    if rotary is None:
        inv_freq, attention_scaling = rope_inv_freq(config, max_model_len)
        positions = max(max_model_len, config.max_position_embeddings)
        rotary = RotaryEmbedding(inv_freq, positions, attention_scaling).to(device)
    model.rotary = rotary
    return model
