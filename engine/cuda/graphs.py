"""Steps captured in CUDA graphs: decode steps, one per padded batch size (and LoRA stack set), and mixed
steps (prefill chunks beside decodes), one per padded (sequences, tokens) shape.

Each graph owns a static int32 input buffer (token ids, positions, cache slots, sequence
lengths, block tables of `max_blocks_per_seq` columns) that the step's one host-to-device
copy fills, a static LoRA metadata the step's metadata is copied into, and reads the grammar
bitmask from fixed slices of the runner's mask buffer. Two graphs per size: the forward (to
float32 logits) and the sampler (bitmask apply + argmax), so the host can fill the grammar
masks between them while the forward runs; a third, the draw, samples rows at their temperature (the
sampler's inverse-CDF draw from the host's uniforms, engine/sampler.py) and the argmax for the rest, when
no row of the step filters with top-k, top-p or min-p. Padding rows write no K/V (slot -1) and attend
to nothing (length 0).

Mixed steps: an eager step costs the host's kernel launches (~17 ms for a 30-layer model on an H100, against
~3.3 ms for a decode graph of 64 rows) whatever its rows, so one tenant's 30-token prompt joined to another's
256 decodes made that step five times longer for all of them. A mixed graph replays the variable-length
prefill kernel, whose grid depends on the padded sizes only (the query offsets, lengths and block tables are
device inputs). Padding sequences have no query rows and no context; padding tokens belong to no sequence,
write no K/V (slot -1) and are never read; the logits are gathered from each sampled row (a static index
buffer), so the sampler graph is the decode graphs' own.

Verification steps (engine/spec: decodes running their draft tokens) are mixed steps whose every draft row's
logits are wanted: their graphs gather up to a set number of logits rows past one per sequence, the sampled rows
first (the sampler graph reads those), then the draft rows, which are verified after the step.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from loraplex.engine.context import LoRAStepContext
from loraplex.engine.cuda.attention import TritonAttentionMetadata
from loraplex.engine.cuda.lora_overlap import SideStreamLoRABatch
from loraplex.engine.cuda.staging import DrawBuffers, GrammarMaskBuffers
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


def mixed_seq_ladder(max_num_seqs: int) -> list[int]:
    """Mixed graphs' sequence counts: powers of two, and max_num_seqs itself (mixed steps are rarer than
    decode steps, and a padded sequence costs one empty attention tile)."""
    sizes = {1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs}
    return sorted(sizes | {max_num_seqs})


def extra_token_ladder(max_num_batched_tokens: int) -> list[int]:
    """Mixed graphs' tokens beyond one a sequence: 16, 32, 64, 128, 256, then fourfold (1024, 4096, ...), and the
    step's token budget itself. A padded step computes at most twice its prompt tokens up to 256 and 4x above.
    The small sizes are the steps that run beside decodes: batch prompts capped at 32 tokens a step beside
    interactive work padded to 64 when the ladder went 16, 64, 256 (on Llama-3.1-8B's shapes, an H200: a step of
    64 decode rows took 5.5 ms, with 64 extra tokens 6.2 ms, ~0.01 ms a padded token); larger steps are rarer
    and prefill-bound, where fewer graphs cost less than the padding."""
    sizes, size = [], 16
    while size < max_num_batched_tokens:
        sizes.append(size)
        size *= 2 if size < 256 else 4
    return [*sizes, max(max_num_batched_tokens, 1)]


@dataclass(slots=True)
class DecodeGraph:
    """A captured step: a decode step of `batch_size` rows, or a mixed step of `batch_size` sequences."""

    batch_size: int
    inputs: torch.Tensor            # int32 decode [4 * b + b * W]: ids, positions, slots, seq_lens, tables
                                    # mixed [3 * t + 2 * b + 1 + r + b * W]: ids, positions, slots (t tokens
                                    # each), seq_lens, cu_seqlens_q, r logit rows (b; more to verify), tables
    lora_meta: LoRAMetadata | None
    logits: torch.Tensor            # [r, vocab] float32, a view of the runner's one shared buffer
    tokens: torch.Tensor            # [b] int64
    forward: torch.cuda.CUDAGraph
    sample: torch.cuda.CUDAGraph
    draw: torch.cuda.CUDAGraph      # the temperature draw (argmax for rows that do not draw)
    drawn: torch.Tensor             # [b] int64, its tokens
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
    draws: DrawBuffers,
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
    lora_meta, lora = _graph_lora(lora_batch, b, device)

    def forward() -> None:
        logits.copy_(step_forward(ids, positions, meta, lora))

    return _captured(b, inputs, lora_meta, logits, forward, masks, draws, pool, device)


MixedStepForward = Callable[
    [torch.Tensor, torch.Tensor, TritonAttentionMetadata, LoRAStepContext | None, torch.Tensor], torch.Tensor]


def capture_mixed_graph(
    *,
    num_seqs: int,
    num_tokens: int,
    max_blocks_per_seq: int,
    block_size: int,
    lora_batch: GraphLoRABatch | None,
    masks: GrammarMaskBuffers,
    draws: DrawBuffers,
    step_forward: MixedStepForward,
    logits: torch.Tensor,
    pool: torch.cuda._POOL_HANDLE,
    device: torch.device,
    num_logit_rows: int | None = None,
    decode_splits: int = 1,
) -> DecodeGraph:
    """`step_forward(ids, positions, attention_metadata, lora, logit_rows)` runs the model to the logits of
    `logit_rows` (int32 [r]: `num_logit_rows`, by default one per sequence; more to verify drafts); the graph
    converts them into `logits` (float32 [r, vocab]). The sampler graph samples the first `num_seqs` rows.
    The step's decodes take the decode kernel with `decode_splits` KV splits, its prompt chunks (and drafts
    to verify) the prefill kernel."""
    b, t, width = num_seqs, num_tokens, max_blocks_per_seq
    r = num_logit_rows or b
    inputs = torch.zeros(3 * t + 2 * b + 1 + r + b * width, dtype=torch.int32, device=device)
    ids, positions, slots, seq_lens, cu_seqlens_q, logit_rows, tables = torch.split(
        inputs, [t, t, t, b, b + 1, r, b * width])
    slots.fill_(-1)  # warm-up and capture runs must not write the cache (and attend to nothing: no query rows)
    meta = TritonAttentionMetadata(block_size, slots, tables.view(b, width), seq_lens, cu_seqlens_q, decode_splits,
                                   decodes_apart=True)
    lora_meta, lora = _graph_lora(lora_batch, t, device)
    logits = logits[:r]

    def forward() -> None:
        logits.copy_(step_forward(ids, positions, meta, lora, logit_rows))

    return _captured(b, inputs, lora_meta, logits, forward, masks, draws, pool, device)


def _captured(b: int, inputs: torch.Tensor, lora_meta: LoRAMetadata | None, logits: torch.Tensor,
              forward: Callable[[], None], masks: GrammarMaskBuffers, draws: DrawBuffers,
              pool: torch.cuda._POOL_HANDLE, device: torch.device) -> DecodeGraph:
    """The step's three graphs (forward, argmax sampler, temperature draw) over the first `b` logits rows."""
    sampled = logits[:b]
    graphs, (tokens, drawn) = _capture(forward, [_sampler(sampled, masks, b), _drawer(sampled, masks, draws, b)],
                                       pool, device)
    forward_graph, sample_graph, draw_graph = graphs
    return DecodeGraph(b, inputs, lora_meta, logits, tokens, forward_graph, sample_graph, draw_graph, drawn)


def _graph_lora(lora_batch: GraphLoRABatch | None, num_tokens: int,
                device: torch.device) -> tuple[LoRAMetadata | None, GraphLoRABatch | None]:
    """The graph's own LoRA metadata for `num_tokens` rows (each replay copies the step's into it), and the
    batch that reads it."""
    if lora_batch is None:
        return None, None
    lora_meta = build_lora_metadata([-1] * num_tokens, max_loras=lora_batch.meta.max_loras, device=device,
                                    block_m=lora_batch.meta.block_m)
    return lora_meta, dataclasses.replace(lora_batch, meta=lora_meta)


def _sampler(logits: torch.Tensor, masks: GrammarMaskBuffers, rows: int) -> Callable[[], torch.Tensor]:
    """The sampler graph's body: the grammar bitmask of the first `rows` rows applied, then the argmax."""
    bitmask, indices = masks.bitmask[:rows], masks.indices[:rows]

    def sample() -> torch.Tensor:
        apply_token_bitmask(logits, bitmask, indices)
        return logits.argmax(dim=-1)

    return sample


def _drawer(logits: torch.Tensor, masks: GrammarMaskBuffers, draws: DrawBuffers,
            rows: int) -> Callable[[], torch.Tensor]:
    """The draw graph's body: the grammar bitmask applied, then each drawing row's inverse-CDF draw at its
    temperature from its uniform (the ops and order of `Sampler.draw` without filters, row by row the same
    arithmetic), and the argmax for the others."""
    bitmask, indices = masks.bitmask[:rows], masks.indices[:rows]
    uniforms, temperatures, drawing = draws.uniforms[:rows], draws.temperatures[:rows], draws.draws[:rows]
    last = logits.shape[-1] - 1

    def draw() -> torch.Tensor:
        apply_token_bitmask(logits, bitmask, indices)
        greedy = logits.argmax(dim=-1)
        cdf = (logits / temperatures.unsqueeze(1)).softmax(dim=-1).cumsum(dim=-1)
        targets = (uniforms * cdf[:, -1]).unsqueeze(1)
        picked = torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=last)
        return torch.where(drawing > 0, picked, greedy)

    return draw


def _capture(forward: Callable[[], None], samplers: list[Callable[[], torch.Tensor]], pool: torch.cuda._POOL_HANDLE,
             device: torch.device) -> tuple[list[torch.cuda.CUDAGraph], list[torch.Tensor]]:
    """Warm `forward` and each sampler up off the capture, then capture each in its own graph (same pool):
    the graphs, forward first, and each sampler graph's output."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # compile kernels and settle the allocator off the capture
        for _ in range(2):
            forward()
            for sample in samplers:
                sample()
    torch.cuda.current_stream(device).wait_stream(stream)
    forward_graph = torch.cuda.CUDAGraph()
    with capturing(forward_graph, pool):
        forward()
    graphs, outputs = [forward_graph], []
    for sample in samplers:
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, pool):
            outputs.append(sample())
        graphs.append(graph)
    return graphs, outputs


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: torch.cuda._POOL_HANDLE | None = None) -> Iterator[None]:
    """`torch.cuda.graph` with Python's cyclic garbage collector paused for the capture.

    A collection that falls inside a capture and destroys an earlier graph left in a reference cycle (a dropped
    engine's, a stale adapter set's) makes a call a capture forbids, and the capture fails at its next launch
    ("operation failed due to a previous error during capture"). Whether a collection falls there depends on what
    ran before, so it struck at random: a test order, or a capture made while serving (a new adapter's set of
    linears, a mixed shape). `torch.cuda.graph` collects once before it begins; nothing is collected during it
    (the pause holds for every thread of the process)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if was_enabled:
            gc.enable()
