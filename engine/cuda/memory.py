"""Size the KV pool from a GPU memory fraction after a profiling forward.

The pool gets `gpu_memory_utilization * total` minus what is in use once the weights are
loaded (weights, CUDA context, other processes), the activation peak of a forward of the
largest step (`max_num_batched_tokens` new tokens, every row's logits), and a reserve for the
decode graphs' static outputs. LoRA slot stacks are not counted: an engine that adds a LoRA
manager should lower the fraction or give `num_blocks`.
"""

from __future__ import annotations

import torch
from loraplex.engine.config import EngineConfig, ModelConfig
from loraplex.engine.context import StepContext
from loraplex.engine.cuda.attention import TritonAttentionMetadata, TritonPagedAttention
from loraplex.engine.model.llama import LlamaForCausalLM

GRAPH_RESERVE_BYTES = 512 << 20


@torch.inference_mode()
def profile_num_blocks(model: LlamaForCausalLM, model_config: ModelConfig, engine_config: EngineConfig) -> int:
    if engine_config.num_blocks is not None:
        return engine_config.num_blocks
    device = torch.device(engine_config.device)
    num_tokens = engine_config.max_num_batched_tokens
    block_size = engine_config.block_size
    num_blocks = -(-num_tokens // block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    shape = (num_blocks * block_size, model.plan.num_kv_heads, model_config.head_dim)
    # One scratch cache serves every layer: only the peak of the activations matters here.
    scratch = (torch.empty(shape, dtype=engine_config.torch_dtype, device=device),
               torch.empty(shape, dtype=engine_config.torch_dtype, device=device))
    positions = torch.arange(num_tokens, dtype=torch.int32, device=device)
    meta = TritonAttentionMetadata(
        block_size=block_size,
        slot_mapping=positions,
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device).view(1, -1),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
    )
    cos, sin = model.rotary.cos_sin(positions)
    ctx = StepContext(attention=meta, cos=cos, sin=sin, backend=TritonPagedAttention())
    hidden = model(torch.zeros(num_tokens, dtype=torch.int32, device=device), ctx, [scratch] * len(model.layers))
    rows = min(num_tokens, engine_config.running_slots())
    model.compute_logits(hidden[:rows]).float().argmax(dim=-1)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - before
    del scratch, hidden, ctx, meta, cos, sin
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    graph_logits = 2 * engine_config.running_slots() * model_config.vocab_size * 4
    # the mixed graphs' hidden states of every token of a step, kept for prompt logprobs (CudaModelRunner)
    graph_logits += engine_config.max_num_batched_tokens * model_config.hidden_size * engine_config.torch_dtype.itemsize
    # The share is this engine's own (weights and all), as in vLLM: other processes on the GPU (another
    # engine, a benchmark's baseline) limit it only through what they leave free.
    own = torch.cuda.memory_reserved(device)
    budget = min(engine_config.gpu_memory_utilization * total - own, free) - activation_peak
    budget -= graph_logits + GRAPH_RESERVE_BYTES
    per_block = engine_config.bytes_per_block(model_config)
    if budget < per_block:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: {engine_config.gpu_memory_utilization:.0%} of "
            f"{total / 2**30:.1f} GiB less this engine's {own / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free) and a "
            f"{activation_peak / 2**30:.2f} GiB activation peak; raise gpu_memory_utilization"
        )
    return int(budget // per_block)
