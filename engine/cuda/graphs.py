"""Decode steps captured in CUDA graphs, one per padded batch size (and LoRA stack set).

Each graph owns a static int32 input buffer (token ids, positions, cache slots, sequence
lengths, block tables of `max_blocks_per_seq` columns) that the step's one host-to-device
copy fills, a static LoRA metadata the step's metadata is copied into, and reads the grammar
bitmask from fixed slices of the runner's mask buffer. Two graphs per size: the forward (to
float32 logits) and the sampler (bitmask apply + argmax), so the host can fill the grammar
masks between them while the forward runs. Padding rows write no K/V (slot -1) and attend
to nothing (length 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from loraplex.engine.context import LoRAStepContext
from loraplex.engine.cuda.attention import TritonAttentionMetadata
from loraplex.engine.cuda.lora_overlap import SideStreamLoRABatch
from loraplex.engine.cuda.staging import GrammarMaskBuffers
from loraplex.engine.kernels.lora_metadata import LoRAMetadata, build_lora_metadata
from loraplex.engine.kernels.token_bitmask import apply_token_bitmask
from loraplex.engine.lora.step import KernelLoRABatch

# The LoRA batches a graph can hold: the kernels' metadata, which each replay copies into the graph's own
GraphLoRABatch = KernelLoRABatch | SideStreamLoRABatch


def graph_lora(lora: LoRAStepContext | None) -> GraphLoRABatch | None:
    """`lora` as a batch a graph can replay; the CUDA runner's LoRA manager builds only those."""
    if lora is not None and not isinstance(lora, KernelLoRABatch | SideStreamLoRABatch):
        raise TypeError(f"a decode graph cannot replay a {type(lora).__name__}")
    return lora


def batch_ladder(max_num_seqs: int) -> list[int]:
    """Graph batch sizes: 1, 2, 4, 8, then every 16, and max_num_seqs itself."""
    sizes = {s for s in (1, 2, 4, 8, *range(16, max_num_seqs + 16, 16)) if s < max_num_seqs}
    return sorted(sizes | {max_num_seqs})


@dataclass(slots=True)
class DecodeGraph:
    batch_size: int
    inputs: torch.Tensor            # int32 [4 * b + b * W]: ids, positions, slots, seq_lens, tables
    lora_meta: LoRAMetadata | None
    logits: torch.Tensor            # [b, vocab] float32, a view of the runner's one shared buffer
    tokens: torch.Tensor            # [b] int64
    forward: torch.cuda.CUDAGraph
    sample: torch.cuda.CUDAGraph
    lora_meta_source: LoRAMetadata | None = None  # whose content `lora_meta` holds now

    def replay_forward(self, lora_batch: GraphLoRABatch | None) -> None:
        if self.lora_meta is not None and lora_batch is not None and lora_batch.meta is not self.lora_meta_source:
            self.lora_meta.copy_(lora_batch.meta)  # a new adapter mix (cached metadata are immutable)
            self.lora_meta_source = lora_batch.meta
        self.forward.replay()


StepForward = Callable[[torch.Tensor, torch.Tensor, TritonAttentionMetadata, LoRAStepContext | None], torch.Tensor]


def capture_decode_graph(
    *,
    batch_size: int,
    max_blocks_per_seq: int,
    block_size: int,
    num_splits: int,
    lora_batch: GraphLoRABatch | None,
    masks: GrammarMaskBuffers,
    step_forward: StepForward,
    logits: torch.Tensor,
    pool: torch.cuda._POOL_HANDLE,  # graph_pool_handle()
    device: torch.device,
) -> DecodeGraph:
    """`step_forward(ids, positions, attention_metadata, lora)` runs the model to logits, which the
    graph converts into `logits` (float32 [b, vocab]: graphs replay one at a time, so every size
    shares one buffer instead of holding its own ~0.5 MB a row)."""
    b, width = batch_size, max_blocks_per_seq
    inputs = torch.zeros(4 * b + b * width, dtype=torch.int32, device=device)
    ids, positions, slots, seq_lens, tables = torch.split(inputs, [b, b, b, b, b * width])
    slots.fill_(-1)  # warm-up and capture runs must not write the cache
    meta = TritonAttentionMetadata(block_size, slots, tables.view(b, width), seq_lens, None, num_splits)
    lora_meta = lora = None
    if lora_batch is not None:
        lora_meta = build_lora_metadata([-1] * b, max_loras=lora_batch.meta.max_loras, device=device,
                                        block_m=lora_batch.meta.block_m)
        lora = dataclasses.replace(lora_batch, meta=lora_meta)
    bitmask, indices = masks.bitmask[:b], masks.indices[:b]

    def forward() -> None:
        logits.copy_(step_forward(ids, positions, meta, lora))

    def sample() -> torch.Tensor:
        apply_token_bitmask(logits, bitmask, indices)
        return logits.argmax(dim=-1)

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # compile kernels and settle the allocator off the capture
        for _ in range(2):
            forward()
            sample()
    torch.cuda.current_stream(device).wait_stream(stream)
    forward_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(forward_graph, pool=pool):
        forward()
    sample_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(sample_graph, pool=pool):
        tokens = sample()
    return DecodeGraph(b, inputs, lora_meta, logits, tokens, forward_graph, sample_graph)
