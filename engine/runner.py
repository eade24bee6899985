"""ModelRunner: turns a scheduled step into tensors, runs the model, samples.

Every runner consumes the same `InputBatch` (engine/input_batch.py); this one
turns it into the CPU attention metadata. `forward_batch` is the device work
every tensor-parallel rank repeats; `execute` adds what rank 0 alone does
(building the batch, sampling, prompt logprobs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from loraplex.engine.attention import ATTENTION_BACKENDS, CpuAttentionMetadata, DecodeTable
from loraplex.engine.config import EngineConfig, ModelConfig
from loraplex.engine.context import (
    AdapterRows,
    DecodeBucket,
    LoRAStepBuilder,
    LoRAStepContext,
    PrefillSpan,
    StepContext,
)
from loraplex.engine.input_batch import InputBatch, StepRows, build_input_batch, prompt_logprob_seqs
from loraplex.engine.kernels import cpu_paged_decode
from loraplex.engine.kv.host_tier import TO_HOST
from loraplex.engine.model.layers import store_linears_column_major
from loraplex.engine.model.llama import LlamaForCausalLM
from loraplex.engine.protocol import TokenLogprob
from loraplex.engine.sampler import Sampler
from loraplex.engine.scheduler import SchedulerOutput
from loraplex.engine.sequence import Sequence

if TYPE_CHECKING:  # the CUDA modules import triton
    from loraplex.engine.cuda.graphs import DecodeGraph
from loraplex.engine.spec.verify import split_verified_logits

# Prompt positions whose logits exist at once when scoring prompt logprobs (`ModelRunner.prompt_logits`): 256 rows
# of a 128k vocabulary are 128 MB in float32, where a 2,048-token chunk's were 1 GB, twice over with log-softmax.
PROMPT_LOGIT_ROWS = 256


class TensorParallelWorkers(Protocol):
    """What rank 0's runner needs of the tensor-parallel workers (engine/parallel/workers.py): each
    operation it sends is applied by every worker, in order, at the same point of its own step."""

    def send(self, op: str, *args: object) -> None: ...


@dataclass(slots=True)
class ForwardOutput:
    hidden: torch.Tensor | None           # [T, hidden]; None after a graph replay
    logits: torch.Tensor | None           # [len(logit_rows), vocab]; None when nothing is sampled
    graph: DecodeGraph | None = None      # the decode graph replayed (CUDA), whose sampler may follow


@dataclass(slots=True)
class StepResult:
    """Per sampled sequence: the next token (and its logprob entry)."""

    sampled: dict[int, int] = field(default_factory=dict)                 # seq_id -> token
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)       # seq_id -> entry
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)  # seq_id -> this chunk's
    errors: dict[int, Exception] = field(default_factory=dict)            # seq_id -> per-request failure
    # seq_id -> [1 + drafts, vocab] host logits of a decode's draft rows, verified by the engine (engine/spec)
    spec_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    # seq_id -> each draft row's argmax, instead of its logits, for a plain greedy sequence
    spec_argmax: dict[int, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class PendingStep:
    """A step launched and not yet read back (overlapped scheduling, engine/step_overlap.py)."""

    scheduled: SchedulerOutput
    seqs: list[Sequence]                  # the sampled rows, in row order
    row_of: dict[int, int]                # seq_id -> its row in `tokens`
    tokens: torch.Tensor | None           # the sampled tokens where the device holds them
    result: StepResult | None = None      # filled at once where the step ran synchronously (CPU)
    host_tokens: torch.Tensor | None = None  # pinned copy of `tokens`, landed once `ready` has
    ready: torch.cuda.Event | None = None  # CUDA event recorded after that copy


class ModelRunner:
    attention_backend_name = "torch"  # the backend whose metadata `_prepare` builds

    @classmethod
    def plan_num_blocks(cls, model: LlamaForCausalLM, model_config: ModelConfig, engine_config: EngineConfig) -> int:
        """KV pool size in blocks, decided before the block manager exists."""
        return engine_config.resolve_num_blocks(model_config)

    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        num_blocks: int,
        tokenizer_vocab_size: int,
        lora: LoRAStepBuilder | None = None,
        num_host_blocks: int = 0,
        workers: TensorParallelWorkers | None = None,
    ) -> None:
        self.model = model
        self.block_size = engine_config.block_size
        self.device = torch.device(engine_config.device)
        if self.device.type == "cpu":
            store_linears_column_major(model)  # the layout the CPU's GEMM is fastest on
        self.lora = lora
        self.workers = workers  # the tensor-parallel workers this rank drives (engine/parallel), or None
        self.attention_backend = ATTENTION_BACKENDS[self.attention_backend_name]()
        self.sampler = Sampler(model_config.vocab_size, tokenizer_vocab_size)
        # Decodes through the C++ kernel when it builds (once per machine, then cached) and fits:
        # then `_prepare` sends a block table + lengths, not length buckets and masks.
        self.use_decode_kernel = (
            self.attention_backend_name == "torch" and self.device.type == "cpu"
            and engine_config.torch_dtype in cpu_paged_decode.SUPPORTED_DTYPES
            and cpu_paged_decode.paged_decode_kernel() is not None
        )
        slots = num_blocks * self.block_size
        shape = (slots, model.plan.num_kv_heads, model_config.head_dim)  # this rank's KV heads
        dtype = engine_config.torch_dtype
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(model_config.num_hidden_layers)
        ]
        # The host tier of pinned session KV (engine/kv/host_tier.py); pinned memory speeds the copies.
        host_shape = (num_host_blocks * self.block_size, *shape[1:])
        pin = self.device.type == "cuda"
        self.host_kv_caches = [
            (torch.zeros(host_shape, dtype=dtype, pin_memory=pin), torch.zeros(host_shape, dtype=dtype, pin_memory=pin))
            for _ in range(model_config.num_hidden_layers)
        ] if num_host_blocks else []

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> StepResult:
        self._copy_blocks(step.blocks_to_copy)
        rows = StepRows.of(step)
        batch = build_input_batch(rows, self.block_size)
        ordered = rows.ordered
        lora = self._lora_for([s for s, _ in ordered], [n for _, n in ordered], batch)
        self.broadcast("step", batch)
        out = self.forward_batch(batch, lora)
        result = StepResult()
        if out.logits is not None:
            logits = split_verified_logits(out.logits, rows, result)
            if rows.sampled or rows.forks:
                self.sampler.sample(logits, rows.sampled + rows.forks, result)
        self._prompt_logprobs(out.hidden, rows, batch, result)
        return result

    def can_launch(self, step: SchedulerOutput) -> bool:
        """Whether `launch` may run this step ahead of the previous one's tokens."""
        return True

    def launch(self, step: SchedulerOutput, feed: PendingStep | None = None) -> PendingStep:
        """Run a decode step whose sequences' last tokens may still be `feed`'s sampled tokens (each
        such sequence carries a placeholder for it). Here the host has them: they are written over
        the placeholders and the step runs at once."""
        if feed is not None:
            sampled = self.collect(feed).sampled
            for seq in step.seqs:
                token = sampled.get(seq.seq_id)
                if token is not None:
                    seq.token_ids[seq.num_computed_tokens] = token
        result = self.execute(step)
        return PendingStep(step, [], {}, None, result=result)

    def collect(self, pending: PendingStep) -> StepResult:
        if pending.result is None:  # this runner's `launch` runs the step at once, so it has its result
            raise RuntimeError("a step launched without its result reached the synchronous runner")
        return pending.result

    def forward_batch(self, batch: InputBatch, lora: LoRAStepContext | None) -> ForwardOutput:
        """The device work of a step, the same on every tensor-parallel rank: the forward, then
        the logits of the sampled rows (prompt-logprob rows follow in `prompt_logits`)."""
        ctx = self._context(batch)
        ctx.lora = lora
        hidden = self.model(torch.from_numpy(batch.input_ids).long(), ctx, self.kv_caches)
        logits = None
        if batch.logit_rows.size:
            logits = self.model.compute_logits(hidden[torch.from_numpy(batch.logit_rows).long()])
        return ForwardOutput(hidden, logits)

    def prompt_logits(self, hidden: torch.Tensor, batch: InputBatch) -> Iterator[tuple[int, torch.Tensor]]:
        """(span index, logits of its next rows): each prompt-logprob span's logits, PROMPT_LOGIT_ROWS rows at a
        time, so a step's whole chunk never has its logits at once (2,048 positions of a 128k vocabulary are 1 GB
        in float32, and log-softmax doubles it). Every tensor-parallel rank runs the same pieces: their gathers
        must match."""
        for index, (start, end) in enumerate(batch.prompt_logprob_spans):
            for at in range(start, end, PROMPT_LOGIT_ROWS):
                yield index, self.model.compute_logits(hidden[at : min(at + PROMPT_LOGIT_ROWS, end)])

    def _lora_for(self, seqs: AdapterRows, token_counts: list[int], batch: InputBatch) -> LoRAStepContext | None:
        """The step's LoRA context; under tensor parallelism also each token's slot, which the
        batch carries to the workers (their slot pools mirror this rank's slot numbers)."""
        if self.lora is None:
            return None
        if self.workers is None:
            return self.lora.build(seqs, token_counts)
        slots = self.lora.token_slots(seqs, token_counts)
        if slots is None:
            return None
        batch.lora_slots = np.asarray(slots, dtype=np.int32)
        return self.lora.batch_of(slots)

    def release_graphs(self) -> None:
        """Drop captured device graphs before the process group goes (none on the CPU)."""

    def step_counts(self) -> dict[str, int]:
        """Steps run so far by how they ran (CUDA: decode graph, mixed-step graph, eager); none on the CPU."""
        return {}

    def step_gpu_times(self) -> dict[str, list[float]]:
        """CUDA: `kind:padded rows` -> [steps, GPU seconds] of the forward passes (engine/cuda/step_timer.py)."""
        return {}

    def broadcast(self, op: str, *args: object) -> None:
        """Send an operation to the tensor-parallel workers (none with one rank)."""
        if self.workers is not None:
            self.workers.send(op, *args)

    def _context(self, batch: InputBatch) -> StepContext:
        """The CPU attention metadata of a batch: length buckets (or the C++ kernel's table) for
        the decodes, one span per prefill chunk, masks built once per step, not per layer."""
        bs = self.block_size
        meta = CpuAttentionMetadata(slot_mapping=torch.from_numpy(batch.slot_mapping).long(), block_size=bs)
        dtype = self.kv_caches[0][0].dtype
        num_decodes = batch.num_decodes
        if num_decodes:  # rows sorted by context length (`StepRows.of`)
            lengths = torch.from_numpy(batch.seq_lens[:num_decodes]).long()
            num_blocks = ((lengths + bs - 1) // bs).tolist()
            table = torch.from_numpy(batch.block_tables[:num_decodes, : num_blocks[-1]]).long()
            meta.num_decode_tokens = num_decodes
            if self.use_decode_kernel:  # the kernel takes the table as is: no buckets, no masks
                meta.decode_table = DecodeTable(table.to(torch.int32), lengths.to(torch.int32))
            buckets = [] if self.use_decode_kernel else decode_buckets(num_blocks)
            for start, end in buckets:
                width = num_blocks[end - 1]
                bucket = DecodeBucket(start, end, table[start:end, :width].reshape(-1))
                span = width * bs
                if int(lengths[start]) < span:  # padding to mask (none when every row fills its blocks)
                    allowed = torch.arange(span) < lengths[start:end].unsqueeze(1)
                    bucket.mask = _additive(allowed.view(end - start, 1, 1, span), dtype)
                meta.decode_buckets.append(bucket)
        cu = batch.cu_seqlens_q
        for i in range(num_decodes, batch.num_seqs):
            row, n, end = int(cu[i]), int(batch.query_lens[i]), int(batch.seq_lens[i])
            start = end - n
            span = PrefillSpan(row, row + n)
            if start > 0:
                span_blocks = -(-end // bs)
                span.context_blocks = torch.from_numpy(batch.block_tables[i, :span_blocks]).long()
                positions = torch.arange(start, end)
                span.mask = _additive(torch.arange(span_blocks * bs).unsqueeze(0) <= positions.unsqueeze(1), dtype)
            meta.prefills.append(span)
        cos, sin = self.model.rotary.cos_sin(torch.from_numpy(batch.positions).long())
        return StepContext(attention=meta, cos=cos, sin=sin, backend=self.attention_backend)

    @torch.inference_mode()
    def swap_kv(self, swaps: list[tuple[str, int, int]]) -> None:
        """Copy whole blocks between the device pool and the host pool, in the order recorded.

        Consecutive copies in one direction run as one gather per layer, unless a
        destination repeats (a slot reused within the step), which starts a new group.
        """
        if swaps:
            self.broadcast("swap_kv", swaps)
        group: list[tuple[int, int]] = []
        direction = None
        for kind, src, dst in swaps:
            if kind != direction or any(d == dst for _, d in group):
                self._swap_group(direction, group)
                group, direction = [], kind
            group.append((src, dst))
        self._swap_group(direction, group)

    def _swap_group(self, direction: str | None, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src, dst = self._block_rows(pairs)
        to_host = direction == TO_HOST
        on_device = (src if to_host else dst).to(self.device)  # once, not once per layer
        for (k, v), (host_k, host_v) in zip(self.kv_caches, self.host_kv_caches, strict=True):
            if to_host:
                # Synchronous: the gathered rows must have landed before the host rows are written.
                host_k[dst] = k[on_device].to("cpu")
                host_v[dst] = v[on_device].to("cpu")
            else:
                k[on_device] = host_k[src].to(k.device, non_blocking=True)
                v[on_device] = host_v[src].to(v.device, non_blocking=True)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        self.broadcast("copy_blocks", copies)
        # The rows' indices cross to the device once: indexing each layer's cache with host indices copied them
        # there four times a layer (on an H200, SmolLM2 shapes, 40 decodes and a new `n: 4` request each step,
        # whose choices copy their shared last block on their first write: 4.9-6.3 ms a step; now 3.6 ms).
        src, dst = (rows.to(self.device) for rows in self._block_rows(copies))
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def _block_rows(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache rows of each (source, destination) block pair: the sources' rows, the destinations'."""
        bs = self.block_size
        src = torch.cat([torch.arange(s * bs, (s + 1) * bs) for s, _ in pairs])
        dst = torch.cat([torch.arange(d * bs, (d + 1) * bs) for _, d in pairs])
        return src, dst

    def _prompt_logprobs(self, hidden: torch.Tensor | None, rows: StepRows, batch: InputBatch,
                         result: StepResult) -> None:
        """Logprob of each prompt token given the tokens before it, chunk by chunk."""
        if not batch.prompt_logprob_spans or hidden is None:
            return
        spans = prompt_logprob_seqs(rows)
        done = [0] * len(spans)  # positions of each span scored so far
        for index, piece in self.prompt_logits(hidden, batch):
            seq, start, end = spans[index]
            at = start + done[index]
            done[index] += piece.shape[0]
            targets = seq.token_ids[at + 1 : min(at + piece.shape[0], end) + 1]  # the span's last may have none yet
            entries = self.sampler.logprob_entries(piece, targets, seq.sampling.prompt_logprobs or 0)
            result.prompt_logprobs.setdefault(seq.seq_id, []).extend(entries)


def _cuda_runner() -> type[ModelRunner]:
    from loraplex.engine.cuda.runner import CudaModelRunner

    return CudaModelRunner


# device type -> runner class; the engine picks by `EngineConfig.device`
RUNNERS: dict[str, Callable[[], type[ModelRunner]]] = {"cpu": lambda: ModelRunner, "cuda": _cuda_runner}


def runner_class_for(device: str) -> type[ModelRunner]:
    return RUNNERS[torch.device(device).type]()


def decode_buckets(num_blocks: list[int], max_buckets: int = 4, overhead: int = 2) -> list[tuple[int, int]]:
    """Split decode rows, sorted by blocks of context, into <= `max_buckets` row ranges [start, end).

    Each bucket is gathered and attended padded to its longest row, so the split minimises
    sum(rows * longest) + `overhead` per bucket (the fixed cost of a gather + SDPA call, in
    blocks). Exact dynamic programme over the distinct lengths: a few hundred steps per step.
    """
    ends: list[int] = []      # row end of each run of equal lengths
    widths: list[int] = []    # that run's blocks
    for i, n in enumerate(num_blocks):
        if widths and widths[-1] == n:
            ends[-1] = i + 1
        else:
            ends.append(i + 1)
            widths.append(n)
    runs = len(widths)
    inf = float("inf")
    # best[k][j]: least cost covering the first j runs with k buckets; cut[k][j]: where the last one starts
    best = [[0.0] + [inf] * runs]
    cut: list[list[int]] = [[0] * (runs + 1)]
    for k in range(1, min(max_buckets, runs) + 1):
        prev, row, cuts = best[-1], [inf] * (runs + 1), [0] * (runs + 1)
        for j in range(1, runs + 1):
            end, width = ends[j - 1], widths[j - 1]
            for i in range(k - 1, j):
                cost = prev[i] + (end - (ends[i - 1] if i else 0)) * width + overhead
                if cost < row[j]:
                    row[j], cuts[j] = cost, i
        best.append(row)
        cut.append(cuts)
    k = min(range(1, len(best)), key=lambda b: best[b][runs])
    buckets: list[tuple[int, int]] = []
    j = runs
    while k:
        i = cut[k][j]
        buckets.append((ends[i - 1] if i else 0, ends[j - 1]))
        j, k = i, k - 1
    return buckets[::-1]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attend-mask as the float mask SDPA would make of it, built once per step, not per layer."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
