"""ModelRunner: turns a scheduled step into tensors, runs the model, samples.

Row order inside a step: every one-token query (decodes) first, so they
share one batched attention call, then each prefill chunk. Step tensors
are built once per step with vectorised index arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from loraplex.engine.attention import ATTENTION_BACKENDS, CpuAttentionMetadata, DecodeTable
from loraplex.engine.config import EngineConfig, ModelConfig
from loraplex.engine.context import DecodeBucket, LoRAStepBuilder, PrefillSpan, StepContext
from loraplex.engine.kernels import cpu_paged_decode
from loraplex.engine.kv.host_tier import TO_HOST
from loraplex.engine.model.llama import LlamaForCausalLM
from loraplex.engine.protocol import TokenLogprob
from loraplex.engine.sampler import Sampler
from loraplex.engine.scheduler import SchedulerOutput
from loraplex.engine.sequence import Sequence


@dataclass(slots=True)
class StepResult:
    """Per sampled sequence: the next token (and its logprob entry)."""

    sampled: dict[int, int] = field(default_factory=dict)                 # seq_id -> token
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)       # seq_id -> entry
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)  # seq_id -> this chunk's
    errors: dict[int, Exception] = field(default_factory=dict)            # seq_id -> per-request failure


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
    ) -> None:
        self.model = model
        self.block_size = engine_config.block_size
        self.device = torch.device(engine_config.device)
        self.lora = lora
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
        shape = (slots, model_config.num_key_value_heads, model_config.head_dim)
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
        decodes = [(s, n) for s, n in zip(step.seqs, step.num_new_tokens, strict=True) if n == 1]
        decodes.sort(key=lambda d: d[0].num_computed_tokens)  # length order: contiguous attention buckets
        prefills = [(s, n) for s, n in zip(step.seqs, step.num_new_tokens, strict=True) if n > 1]
        forks = [s for s, n in zip(step.seqs, step.num_new_tokens, strict=True) if n == 0]
        ordered = decodes + prefills
        input_ids, ctx, last_row = self._prepare(decodes, prefills)
        if self.lora is not None:
            ctx.lora = self.lora.build([s for s, _ in ordered], [n for _, n in ordered])
        hidden = self.model(input_ids, ctx, self.kv_caches)

        result = StepResult()
        sample_seqs = [s for s, n in ordered if s.num_computed_tokens + n == len(s.token_ids)]
        sample_seqs += forks
        rows = [last_row[s.seq_id] for s in sample_seqs[: len(sample_seqs) - len(forks)]]
        rows += [last_row[s.parent.seq_id] for s in forks]
        if sample_seqs:
            logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long)])
            self.sampler.sample(logits, sample_seqs, result)
        self._prompt_logprobs(hidden, ordered, last_row, result)
        return result

    def _prepare(
        self, decodes: list[tuple[Sequence, int]], prefills: list[tuple[Sequence, int]]
    ) -> tuple[torch.Tensor, StepContext, dict[int, int]]:
        bs = self.block_size
        ids: list[int] = []
        pos_chunks: list[torch.Tensor] = []
        slot_chunks: list[torch.Tensor] = []
        last_row: dict[int, int] = {}
        meta = CpuAttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_size=bs)
        if decodes:
            seqs = [s for s, _ in decodes]  # sorted by context length in `execute`
            lengths = torch.tensor([s.num_computed_tokens + 1 for s in seqs], dtype=torch.long)
            num_blocks = [(s.num_computed_tokens + bs) // bs for s in seqs]
            table = torch.tensor([_padded(s.block_table, num_blocks[-1]) for s in seqs], dtype=torch.long)
            meta.num_decode_tokens = len(seqs)
            dtype = self.kv_caches[0][0].dtype
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
            ids.extend(s.token_ids[s.num_computed_tokens] for s in seqs)
            positions = lengths - 1
            pos_chunks.append(positions)
            slot_chunks.append(table.gather(1, (positions // bs).unsqueeze(1)).squeeze(1) * bs + positions % bs)
            for i, s in enumerate(seqs):
                last_row[s.seq_id] = i
        row = len(ids)
        for seq, n in prefills:
            start = seq.num_computed_tokens
            end = start + n
            ids.extend(seq.token_ids[start:end])
            num_blocks = (end + bs - 1) // bs
            blocks = torch.tensor(seq.block_table[:num_blocks], dtype=torch.long)
            positions = torch.arange(start, end)
            pos_chunks.append(positions)
            slot_chunks.append(blocks[positions // bs] * bs + positions % bs)
            span = PrefillSpan(row, row + n)
            if start > 0:
                span.context_blocks = blocks
                span.mask = _additive(torch.arange(num_blocks * bs).unsqueeze(0) <= positions.unsqueeze(1),
                                      self.kv_caches[0][0].dtype)
            meta.prefills.append(span)
            row += n
            last_row[seq.seq_id] = row - 1
        positions = torch.cat(pos_chunks)
        meta.slot_mapping = torch.cat(slot_chunks)
        cos, sin = self.model.rotary.cos_sin(positions)
        input_ids = torch.tensor(ids, dtype=torch.long)
        return input_ids, StepContext(attention=meta, cos=cos, sin=sin, backend=self.attention_backend), last_row

    @torch.inference_mode()
    def swap_kv(self, swaps: list[tuple[str, int, int]]) -> None:
        """Copy whole blocks between the device pool and the host pool, in the order recorded.

        Consecutive copies in one direction run as one gather per layer, unless a
        destination repeats (a slot reused within the step), which starts a new group.
        """
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
        bs = self.block_size
        src = torch.cat([torch.arange(s * bs, (s + 1) * bs) for s, _ in pairs])
        dst = torch.cat([torch.arange(d * bs, (d + 1) * bs) for _, d in pairs])
        to_host = direction == TO_HOST
        for (k, v), (host_k, host_v) in zip(self.kv_caches, self.host_kv_caches, strict=True):
            if to_host:
                # Synchronous: the gathered rows must have landed before the host rows are written.
                host_k[dst] = k[src.to(k.device)].to("cpu")
                host_v[dst] = v[src.to(v.device)].to("cpu")
            else:
                k[dst.to(k.device)] = host_k[src].to(k.device, non_blocking=True)
                v[dst.to(v.device)] = host_v[src].to(v.device, non_blocking=True)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        bs = self.block_size
        src = torch.cat([torch.arange(s * bs, (s + 1) * bs) for s, _ in copies])
        dst = torch.cat([torch.arange(d * bs, (d + 1) * bs) for _, d in copies])
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def _prompt_logprobs(
        self, hidden: torch.Tensor, ordered: list[tuple[Sequence, int]], last_row: dict[int, int],
        result: StepResult,
    ) -> None:
        """Logprob of each prompt token given the tokens before it, chunk by chunk."""
        for seq, n in ordered:
            if not seq.wants_prompt_logprobs:
                continue
            start = seq.num_computed_tokens
            end = min(start + n, seq.num_prompt_tokens - 1)  # the last prompt row predicts output
            if end <= start:
                continue
            first_row = last_row[seq.seq_id] - n + 1
            logits = self.model.compute_logits(hidden[first_row : first_row + end - start])
            targets = seq.token_ids[start + 1 : end + 1]
            result.prompt_logprobs[seq.seq_id] = self.sampler.logprob_entries(
                logits, targets, seq.sampling.prompt_logprobs or 0
            )


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


def _padded(block_table: list[int], length: int) -> list[int]:
    """The first `length` block ids, padded with block 0 (masked out) for shorter sequences."""
    head = block_table[:length]
    return head + [0] * (length - len(head))


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attend-mask as the float mask SDPA would make of it, built once per step, not per layer."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
