"""CudaModelRunner: the CUDA path of `ModelRunner` (Triton attention, decode CUDA graphs).

Per step: integer inputs are packed on the host into one pinned buffer and cross in one copy
(`PinnedStaging`); the forward runs as a graph replay (decode-only steps, batch padded to the
next ladder size), as a mixed-step graph replay (prefill chunks beside decodes, padded to a
(sequences, tokens) shape) or eagerly (prompt logprobs under tensor
parallelism, graphs off); steps verifying speculative drafts replay mixed graphs that gather
every draft row's logits, whose argmax (greedy rows) is taken on the GPU; while the GPU computes, the host
fills the grammar bitmask of the sampled rows, which then crosses in one copy and is applied
on the GPU before the argmax. Requests that need the full sampler (temperature, penalties,
logprobs) take the base runner's host sampler on their logits.

The KV pool keeps the base runner's flat layout `[slots, kv_heads, D]` (block copies and host
swaps are inherited unchanged); the attention backend views it as blocks.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from loraplex.engine.config import EngineConfig, ModelConfig
from loraplex.engine.context import AdapterRow, AdapterRows, LoRAStepBuilder, LoRAStepContext, StepContext
from loraplex.engine.cuda.attention import TritonAttentionMetadata
from loraplex.engine.cuda.device_logprobs import DeviceLogprobs
from loraplex.engine.cuda.fused_ops import fuse_model
from loraplex.engine.cuda.graphs import (
    DecodeGraph,
    batch_ladder,
    capture_decode_graph,
    capture_mixed_graph,
    extra_token_ladder,
    graph_lora,
    mixed_seq_ladder,
)
from loraplex.engine.cuda.lora_overlap import SideStreamLoRABatch
from loraplex.engine.cuda.memory import profile_num_blocks
from loraplex.engine.cuda.staging import DrawBuffers, GrammarMaskBuffers, PinnedStaging
from loraplex.engine.cuda.step_timer import StepTimer
from loraplex.engine.input_batch import InputBatch, StepRows, build_input_batch
from loraplex.engine.kernels.paged_attention_decode import choose_num_splits
from loraplex.engine.kernels.token_bitmask import apply_token_bitmask
from loraplex.engine.lora.slot_pool import EVERY_LINEAR
from loraplex.engine.model.llama import LlamaForCausalLM
from loraplex.engine.runner import ForwardOutput, ModelRunner, PendingStep, StepResult, TensorParallelWorkers
from loraplex.engine.sampler import draws_at_random, draws_by_temperature_alone, row_uniform
from loraplex.engine.scheduler import SchedulerOutput
from loraplex.engine.sequence import Sequence
from loraplex.engine.spec.policy import COMPUTE_BOUND_TOKENS
from loraplex.engine.spec.verify import split_verified_logits

logger = logging.getLogger(__name__)
PEFT_DEFAULT_TARGETS = {"q_proj", "v_proj"}  # what PEFT's LoraConfig adapts in a Llama model unless told otherwise


@dataclass(frozen=True, slots=True)
class _PaddingRow:
    """What a padded graph row looks like to the LoRA builder: a row on the base model."""

    adapter_id: str | None = None


_PADDING_ROW = _PaddingRow()


def _padded(rows: list[Sequence], size: int) -> list[AdapterRow]:
    return [*rows, *[_PADDING_ROW] * (size - len(rows))]


def needs_host_sampler(seq: Sequence) -> bool:
    """Its logits change by its own history or the caller's bias before it samples: the host sampler does that.
    (Logprobs alone do not: they are made on the GPU, engine/cuda/device_logprobs.py.)"""
    sampling = seq.sampling
    return (
        bool(sampling.presence_penalty or sampling.frequency_penalty)
        or sampling.repetition_penalty != 1.0
        or bool(sampling.logit_bias)
        or (bool(seq.min_tokens_ban_ids) and seq.num_output_tokens < sampling.min_tokens)
    )


class CudaModelRunner(ModelRunner):
    attention_backend_name = "triton"

    @classmethod
    def plan_num_blocks(cls, model: LlamaForCausalLM, model_config: ModelConfig, engine_config: EngineConfig) -> int:
        fuse_model(model)
        return profile_num_blocks(model, model_config, engine_config)

    def __init__(self, model: LlamaForCausalLM, model_config: ModelConfig, engine_config: EngineConfig,
                 num_blocks: int, tokenizer_vocab_size: int, lora: LoRAStepBuilder | None = None,
                 num_host_blocks: int = 0, workers: TensorParallelWorkers | None = None) -> None:
        fuse_model(model)
        super().__init__(model, model_config, engine_config, num_blocks, tokenizer_vocab_size, lora=lora,
                         num_host_blocks=num_host_blocks, workers=workers)
        self.num_kv_heads = model.plan.num_kv_heads
        self.head_dim = model_config.head_dim
        max_model_len = engine_config.resolve_max_model_len(model_config)
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.ladder = batch_ladder(engine_config.running_slots())
        self.use_graphs = engine_config.enable_cuda_graphs and self.device.type == "cuda"
        # Mixed-step graphs need one rank: tensor-parallel workers replay only the decode graphs.
        self.use_mixed_graphs = self.use_graphs and engine_config.cuda_graph_mixed_steps and workers is None
        self.mixed_seq_sizes = mixed_seq_ladder(engine_config.running_slots())
        self.mixed_extra_sizes = extra_token_ladder(engine_config.max_num_batched_tokens)
        self.max_num_batched_tokens = engine_config.max_num_batched_tokens
        seqs, tokens = engine_config.running_slots(), engine_config.max_num_batched_tokens
        # Verification steps replay mixed graphs of their own, which gather up to this many draft rows' logits: the
        # drafts of every sequence, as far as a step stays under the GPU's compute bound (past which `auto` drafts
        # nothing), not a row per token of the step's budget.
        speculation = engine_config.speculation(max_model_len)
        self.verify_extra_tokens = 0
        if self.use_mixed_graphs and speculation.drafts:
            wanted = min(seqs * speculation.num_tokens, COMPUTE_BOUND_TOKENS["cuda"])
            self.verify_extra_tokens = next((n for n in self.mixed_extra_sizes if n >= wanted),
                                            self.mixed_extra_sizes[-1])
        capacity = 3 * tokens + 4 * seqs + seqs * self.max_blocks_per_seq + 2
        self.staging = PinnedStaging(capacity, self.device)
        # Overlapped steps alternate two pinned input buffers and two pinned token buffers: a buffer
        # is refilled only after the step before the previous one was read back (its copies are done).
        self._launch_stagings = [self.staging, PinnedStaging(seqs * (4 + self.max_blocks_per_seq) + 2, self.device)]
        pin = self.device.type == "cuda"
        self._launch_tokens = [torch.empty(max(self.ladder[-1], seqs), dtype=torch.int64, pin_memory=pin)
                               for _ in range(2)]
        # ... and two events marking their tokens' copy, recorded on the engine's stream (looked up once)
        self._launch_ready = [torch.cuda.Event() for _ in range(2)] if pin else []
        self._stream: torch.cuda.Stream | None = None
        self._num_launched = 0
        self.masks = GrammarMaskBuffers(max(self.ladder[-1], seqs), model_config.vocab_size,
                                        self.sampler.tokenizer_vocab_size, self.device)
        self.draws = DrawBuffers(max(self.ladder[-1], seqs), self.device)
        self.num_graph_draws = 0  # steps whose random rows drew inside a graph
        # (padded size, LoRA kind): None (base rows only), "lora" (every linear's LoRA stacks) or "lora:<linears>"
        # (those some resident adapter adapts: `_lora_kind`)
        self.graphs: dict[tuple[int, str | None], DecodeGraph] = {}
        # (sequences, tokens, kind): kind None (base model), a LoRA kind, "verify" or "<LoRA kind>+verify"
        self.mixed_graphs: dict[tuple[int, int, str | None], DecodeGraph] = {}
        self._graph_pool: torch.cuda._POOL_HANDLE | None = None
        self.last_graph: DecodeGraph | None = None
        self._shared_logits: torch.Tensor | None = None
        self._shared_hidden: torch.Tensor | None = None
        self.hidden_size = model_config.hidden_size
        self.vocab_size = model_config.vocab_size
        self.num_graph_steps = 0
        self.num_mixed_graph_steps = 0
        self.num_eager_steps = 0
        self.step_timer = StepTimer()  # GPU time of each forward pass, by kind and padded rows
        self._lora_stream: torch.cuda.Stream | None = None
        self._lora_graphs_of: LoRAStepBuilder | None = None  # whose slot stacks the LoRA graphs read

    # LoRA work on a side stream beside each base GEMM ("delta" or "shrink", engine/cuda/lora_overlap.py);
    # None: after the GEMM on the main stream, the default: on the H100 at batch 64 with 8 adapters the side
    # stream gained nothing ("shrink" 1.132x the base step vs 1.142x; "delta" 1.170x: the GEMM holds every
    # SM, so the LoRA kernels only stretch). Tensor-parallel ranks never overlap (see LoRALinear).
    lora_overlap: str | None = None

    def _lora_for(self, seqs: AdapterRows, token_counts: list[int], batch: InputBatch) -> LoRAStepContext | None:
        return self._on_side_stream(super()._lora_for(seqs, token_counts, batch))

    def _on_side_stream(self, lora: LoRAStepContext | None) -> LoRAStepContext | None:
        if self.lora_overlap is None or self.device.type != "cuda" or self.workers is not None:
            return lora
        if self._lora_stream is None:
            self._lora_stream = torch.cuda.Stream(self.device)
        return SideStreamLoRABatch.wrap(lora, self._lora_stream, self.lora_overlap)

    # ---- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> StepResult:
        self._copy_blocks(step.blocks_to_copy)
        rows = StepRows.of(step)
        ordered = rows.ordered
        mixed = self.mixed_shape(rows)
        if self.use_graphs and rows.is_plain_decode:
            size = self.padded_size(len(rows.decodes))
            batch = build_input_batch(rows, self.block_size, table_width=self.max_blocks_per_seq, pad_to=size)
            batch.use_graph = True
            lora = self._lora_for(_padded(rows.decodes, size), [1] * size, batch)
        elif mixed is not None:
            batch, lora = self._mixed_batch(rows, mixed[1])
        else:
            # Decode-only steps use the graphs' table width and split count, so graphs on or off
            # run the same attention arithmetic.
            width = self.max_blocks_per_seq if not rows.prefills else None
            batch = build_input_batch(rows, self.block_size, table_width=width)
            lora = self._lora_for([s for s, _ in ordered], [n for _, n in ordered], batch)
        if mixed is not None:
            out = self._replay_mixed(batch, lora, *mixed)
        else:
            self.broadcast("step", batch)
            out = self.forward_batch(batch, lora)
        result = StepResult()
        if out.logits is not None:
            logits = split_verified_logits(out.logits, rows, result)
            if rows.sampled or rows.forks:
                self._sample(logits, rows.sampled + rows.forks, result, out.graph)
        self._prompt_logprobs(out.hidden, rows, batch, result)
        return result

    def _mixed_batch(self, rows: StepRows, num_tokens: int) -> tuple[InputBatch, LoRAStepContext | None]:
        """A mixed-graph step's inputs and LoRA context, padded to the graph's `num_tokens` tokens."""
        ordered = rows.ordered
        batch = build_input_batch(rows, self.block_size, table_width=self.max_blocks_per_seq)
        counts = [n for _, n in ordered]
        padding = [_PADDING_ROW] if num_tokens > batch.num_tokens else []
        lora = self._lora_for([*(s for s, _ in ordered), *padding],
                              [*counts, *[num_tokens - batch.num_tokens] * len(padding)], batch)
        return batch, lora

    # ---- overlapped steps (engine/step_overlap.py) ----------------------------------------
    def can_launch(self, step: SchedulerOutput) -> bool:
        """A step that replays a graph (a decode graph, or a mixed-step graph: prefill chunks beside decodes)
        whose every sampled row samples on the GPU without a grammar (the graph samples the argmax; rows at a
        temperature alone draw in the graph, from the host's uniform for their next position)."""
        if not self.use_graphs or step.blocks_to_copy:
            return False
        rows = StepRows.of(step)
        if rows.forks:  # a request's choices fork: `execute` samples each from its parent's row
            return False
        if rows.is_plain_decode:
            fits = len(rows.decodes) <= self.ladder[-1]
        else:  # a launched step returns its tokens alone: prompt logprobs are made by `execute`
            fits = (bool(rows.prefills) and not rows.verified and self.mixed_shape(rows) is not None
                    and not any(s.wants_prompt_logprobs for s, _ in rows.ordered))
        return fits and not any(needs_host_sampler(s) or s.sampling.logprobs is not None or s.matcher is not None
                                or s.forced_token_ids
                                or (draws_at_random(s) and not self._draws_ahead(s)) for s in rows.sampled)

    def _draws_ahead(self, seq: Sequence) -> bool:
        """A random row a step launched ahead can draw: the graph's temperature draw, from the host's uniform
        for its next position, on one rank (tensor-parallel ranks would each need the same uniforms)."""
        return self.workers is None and draws_by_temperature_alone(seq)

    @torch.inference_mode()
    def launch(self, step: SchedulerOutput, feed: PendingStep | None = None) -> PendingStep:
        """Replay the step's graphs (decode, or mixed where prefill chunks run beside decodes) and start the
        tokens' copy to the host; return without waiting. A decode in `feed` (the step still in flight) takes
        its input id from `feed`'s sampled tokens on the GPU (`_feed_input_ids`); every other token is known."""
        rows = StepRows.of(step)
        mixed = None if rows.is_plain_decode else self.mixed_shape(rows)
        if mixed is None:
            size = self.padded_size(len(rows.decodes))
            batch = build_input_batch(rows, self.block_size, table_width=self.max_blocks_per_seq, pad_to=size)
            batch.use_graph = True
            lora = self._lora_for(_padded(rows.decodes, size), [1] * size, batch)
        else:
            batch, lora = self._mixed_batch(rows, mixed[1])
        feed_tokens = None
        if feed is not None:
            _feed_input_ids(batch, rows.decodes, feed.row_of)
            feed_tokens = feed.tokens
        which = self._num_launched % 2
        if mixed is None:
            # Tensor-parallel workers replay the same step and sample the same greedy tokens from the
            # same gathered logits, so a fed step finds the previous tokens on every rank (mixed-step graphs
            # run on one rank only).
            self.broadcast("launch", batch, feed is not None)
            graph = self.replay_launched(batch, lora, feed_tokens)
        else:
            self._num_launched += 1
            replayed = self._replay_mixed(batch, lora, *mixed, staging=self._launch_stagings[which],
                                          feed_tokens=feed_tokens).graph
            assert replayed is not None  # a mixed step always replays a graph
            graph = replayed
        errors: dict[int, Exception] = {}
        self.masks.upload(self.masks.fill(rows.sampled, errors))  # no grammar rows: clears the indices
        drawing = [i for i, s in enumerate(rows.sampled) if draws_at_random(s)]
        if drawing:  # each row's uniform is its next position's: the sequences carry the placeholder
            tokens = self._replay_draw(graph, rows.sampled, drawing)
        else:
            graph.sample.replay()
            tokens = graph.tokens
        count = len(rows.sampled)
        host = self._launch_tokens[which]
        host[:count].copy_(tokens[:count], non_blocking=True)
        if self._stream is None:
            self._stream = torch.cuda.current_stream()
        ready = self._launch_ready[which]
        ready.record(self._stream)
        return PendingStep(step, rows.sampled, {s.seq_id: i for i, s in enumerate(rows.sampled)}, tokens,
                           host_tokens=host, ready=ready)

    def replay_launched(self, batch: InputBatch, lora: LoRAStepContext | None,
                        feed_tokens: torch.Tensor | None) -> DecodeGraph:
        """Replay an overlapped step's decode graph from the next of the two launch stagings."""
        which = self._num_launched % 2
        self._num_launched += 1
        return self._replay_decode(batch, lora, staging=self._launch_stagings[which], feed_tokens=feed_tokens)

    def collect(self, pending: PendingStep) -> StepResult:
        if pending.ready is None or pending.host_tokens is None:  # not launched ahead: ran synchronously
            return super().collect(pending)
        pending.ready.synchronize()
        result = StepResult()
        tokens = pending.host_tokens[: len(pending.seqs)].tolist()
        for seq, token in zip(pending.seqs, tokens, strict=True):
            result.sampled[seq.seq_id] = token
        return result

    def forward_batch(self, batch: InputBatch, lora: LoRAStepContext | None) -> ForwardOutput:
        if batch.use_graph:
            graph = self._replay_decode(batch, lora)
            return ForwardOutput(None, graph.logits[: batch.num_seqs], graph)
        return self._forward_eager(batch, lora)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], result: StepResult,
                graph: DecodeGraph | None) -> None:
        """On the GPU, with the grammar mask filled meanwhile: the argmax, or for random rows (temperature,
        top-k, top-p, min-p, seeds) the sampler's draw run on the GPU, from the same per-sequence uniforms.
        Rows that need penalties, biases or min_tokens bans take the host sampler: only their logits go to the
        host, so one tenant's penalty does not send every row of the step there (with 64 rows that was ~12 MB of
        logits a step and each random row's top-p sort on the host). Logprobs are made on the GPU."""
        host = frozenset(i for i, s in enumerate(seqs) if needs_host_sampler(s))
        if len(host) == len(seqs):
            self.sampler.sample(logits.float().cpu(), seqs, result)
            return
        count = self.masks.fill(seqs, result.errors, skip=host)  # overlaps the forward still running
        scored = [i for i, s in enumerate(seqs) if i not in host and s.sampling.logprobs is not None]
        logprobs = DeviceLogprobs(logits, seqs, scored) if scored else None  # before the mask changes the logits
        self.masks.upload(count)
        drawing = [i for i, s in enumerate(seqs) if i not in host and draws_at_random(s)]
        if graph is not None and not drawing:
            graph.sample.replay()
            tokens = graph.tokens[: len(seqs)].tolist()
        elif (graph is not None and len(seqs) <= graph.batch_size
              and all(draws_by_temperature_alone(seqs[i]) for i in drawing)):
            tokens = self._replay_draw(graph, seqs, drawing)[: len(seqs)].tolist()
        else:
            if count > self.masks.max_rows:  # some row has a grammar; otherwise the kernel would mask nothing
                apply_token_bitmask(logits, self.masks.bitmask[: len(seqs)], self.masks.indices[: len(seqs)])
            tokens = self.sampler.draw(logits.float(), seqs) if drawing else logits.argmax(dim=-1).tolist()
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            if i not in host:
                result.sampled[seq.seq_id] = seq.forced_token_ids[0] if seq.forced_token_ids else token
        if logprobs is not None:
            taken = [result.sampled[seqs[i].seq_id] for i in scored]
            for i, entry in zip(scored, logprobs.entries(taken), strict=True):
                result.logprobs[seqs[i].seq_id] = entry
        if host:
            rows = sorted(host)
            on_host = logits[torch.tensor(rows, device=logits.device)].float().cpu()
            self.sampler.sample(on_host, [seqs[i] for i in rows], result)

    def _replay_draw(self, graph: DecodeGraph, seqs: list[Sequence], drawing: list[int]) -> torch.Tensor:
        """The graph's temperature draw for rows `drawing` of `seqs` (the others' argmax); its tokens tensor."""
        self.draws.upload([row_uniform(seqs[i]) for i in drawing], [seqs[i].sampling.temperature for i in drawing],
                          drawing)
        graph.draw.replay()
        self.num_graph_draws += 1
        return graph.drawn

    # ---- decode through graphs ------------------------------------------------------------
    @torch.inference_mode()
    def capture_decode_graphs(self) -> int:
        """Capture the decode graph of every ladder size now (at start-up, as a server does), instead
        of on each size's first use in the middle of serving; returns how many were captured.

        With adapters served on one rank, the LoRA graph of every size too: a graph reads the slot
        stacks, which exist from the start, and takes each step's adapter mix as metadata copied
        into it (a first capture, with every row on the base, is what a first use captures too).
        Tensor-parallel ranks still capture LoRA graphs on first use, all ranks together."""
        if not self.use_graphs:
            return 0
        self.broadcast("capture_decode_graphs")
        self._forget_stale_lora_graphs()
        kinds: list[str | None] = [None] + (["lora"] if self.lora is not None and self.workers is None else [])
        missing = [(size, kind) for kind in kinds for size in self.ladder if (size, kind) not in self.graphs]
        for size, kind in sorted(missing, key=lambda key: -key[0]):  # largest first: smaller ones reuse the pool
            lora = None if kind is None or self.lora is None else self._on_side_stream(
                self.lora.batch_of([-1] * size, EVERY_LINEAR))
            self.graphs[(size, kind)] = self._capture(size, lora)
        return len(missing)

    def _forget_stale_lora_graphs(self) -> None:
        """A new LoRA manager (`LLMEngine.serve_adapters`) brings new slot stacks: graphs captured on the
        old ones would read them, so they go and are captured again on the new ones."""
        if self._lora_graphs_of is not self.lora:
            for key in [k for k in self.graphs if k[1] is not None and k[1].startswith("lora")]:
                del self.graphs[key]
            for mixed_key in [k for k in self.mixed_graphs if k[2] is not None and k[2].startswith("lora")]:
                del self.mixed_graphs[mixed_key]
            self._lora_graphs_of = self.lora

    def step_counts(self) -> dict[str, int]:
        return {"decode_graph": self.num_graph_steps, "mixed_graph": self.num_mixed_graph_steps,
                "eager": self.num_eager_steps}

    def step_gpu_times(self) -> dict[str, list[float]]:
        return self.step_timer.snapshot()

    def release_graphs(self) -> None:
        """Drop every captured graph: NCCL finalizes a communicator only once no graph holds it."""
        self.graphs.clear()
        self.mixed_graphs.clear()
        self.last_graph = None
        self._graph_pool = None
        torch.cuda.synchronize(self.device)
        gc.collect()

    @torch.inference_mode()
    def capture_mixed_graphs(self) -> int:
        """Capture every mixed-step graph now (at start-up), largest first, for the base model and, with
        adapters, for LoRA rows, and where steps may verify drafts their verification graphs; returns how many
        were captured."""
        if not self.use_mixed_graphs:
            return 0
        self._forget_stale_lora_graphs()
        missing = []
        for lora_kind in [False, True] if self.lora is not None else [False]:
            for verify in (False, True) if self.verify_extra_tokens else (False,):
                kind = _mixed_kind("lora" if lora_kind else None, verify)
                missing += [(s, t, kind) for s, t in self.mixed_shapes() if (s, t, kind) not in self.mixed_graphs]
        for s, t, kind in sorted(missing, key=lambda key: (-key[1], -key[0])):
            lora = None if not kind or not kind.startswith("lora") or self.lora is None else (
                self._on_side_stream(self.lora.batch_of([-1] * t, EVERY_LINEAR)))
            self.mixed_graphs[(s, t, kind)] = self._capture_mixed(s, t, lora, verify=kind is not None and "verify" in kind)
        return len(missing)

    @torch.inference_mode()
    def capture_default_target_graphs(self) -> int:
        """At start-up, with adapters served on one rank: every graph of adapters on PEFT's default targets
        (q_proj and v_proj: LoRA kernels at the merged q/k/v projection alone), the set most adapters have, so the
        first step on one does not capture them all while every request in flight waits (41 graphs, 4.2 s on an
        H200 with SmolLM2 shapes). Returns how many were captured."""
        pool = getattr(self.lora, "pool", None)  # the LoRA manager's slot pool
        if self.lora is None or pool is None or self.workers is not None or not self.use_graphs:
            return 0
        self._forget_stale_lora_graphs()
        signature = pool.signature_for_targets(PEFT_DEFAULT_TARGETS)
        if signature in ("", EVERY_LINEAR):
            return 0
        before = len(self.graphs) + len(self.mixed_graphs)
        self._capture_every_graph_of(self.lora.batch_of([-1], signature))
        return len(self.graphs) + len(self.mixed_graphs) - before

    def _capture_every_graph_of(self, lora: LoRAStepContext | None) -> None:
        """On the first step of a set of adapted linears (a LoRA signature, `_lora_kind`): every decode and mixed
        graph of that signature now, in one stall of the engine's loop. Start-up captures the base model's graphs
        and those with LoRA kernels at every linear; which linears resident adapters adapt is known only once they
        are loaded. Captured shape by shape on each one's first step, they made dozens of 30-80 ms stalls spread
        over the first minutes of traffic, each delaying every request in flight (on an H200 they set the p95 of
        interactive requests beside a batch job). Signatures are few (`slot_pool.MAX_SIGNATURES`). Tensor-parallel
        ranks keep capturing on first use, all ranks together."""
        kind = _lora_kind(lora)
        if (lora is None or self.lora is None or self.workers is not None or kind is None or kind == "lora"
                or any(key[1] == kind for key in self.graphs)):
            return
        signature = getattr(lora, "signature", EVERY_LINEAR)
        if not signature:  # no resident adapter adapts anything: nothing to capture ahead
            return
        started, count = time.perf_counter(), 0
        if self.use_graphs:
            for size in sorted(self.ladder, reverse=True):  # largest first: smaller ones reuse the pool
                if (size, kind) not in self.graphs:
                    self.graphs[(size, kind)] = self._capture(size, self._on_side_stream(
                        self.lora.batch_of([-1] * size, signature)))
                    count += 1
        if self.use_mixed_graphs:
            for verify in (False, True) if self.verify_extra_tokens else (False,):
                mixed_kind = _mixed_kind(kind, verify)
                for s, t in sorted(self.mixed_shapes(), key=lambda shape: (-shape[1], -shape[0])):
                    if (s, t, mixed_kind) not in self.mixed_graphs:
                        self.mixed_graphs[(s, t, mixed_kind)] = self._capture_mixed(
                            s, t, self._on_side_stream(self.lora.batch_of([-1] * t, signature)), verify=verify)
                        count += 1
        logger.info("captured %d CUDA graphs for adapters on %s in %.2f s", count, signature,
                    time.perf_counter() - started)

    def mixed_shapes(self) -> list[tuple[int, int]]:
        """Every padded (sequences, tokens) a step can take: one whose smallest step (one sequence more than the
        size below it, one token more than the padding below it) passes the step's token budget never runs."""
        shapes = []
        for i, seqs in enumerate(self.mixed_seq_sizes):
            fewest_seqs = self.mixed_seq_sizes[i - 1] + 1 if i else 1
            for j, extra in enumerate(self.mixed_extra_sizes):
                fewest_extra = self.mixed_extra_sizes[j - 1] + 1 if j else 1
                if fewest_seqs + fewest_extra <= self.max_num_batched_tokens:
                    shapes.append((seqs, seqs + extra))
        return shapes

    def mixed_shape(self, rows: StepRows) -> tuple[int, int] | None:
        """The padded (sequences, tokens) of the mixed graph that runs this step, or None: eager. Under tensor
        parallelism there are no mixed graphs; on one GPU, verification steps with more draft rows than the
        verification graphs gather stay eager. A prompt-logprobs step replays a graph too: the graph keeps every
        token's hidden state: an evaluation tenant's scoring
        requests used to make each step they were in eager, every tenant's decodes with it (64 rows of SmolLM2
        shapes on an H200, a 200-token scoring prompt in each step: 3.6-4.3 ms a step against 3.1 ms; now 3.1 ms).
        A fork (a choice of an `n` > 1 request) is one more logits row, its parent's gathered again: the graph is
        padded to enough sequences that every sampled row and fork has a row the sampler graph reads."""
        if not self.use_mixed_graphs or not (rows.prefills or rows.forks):  # a parent's last chunk may be 1 token
            return None
        ordered = rows.ordered
        num_seqs = len(ordered)
        extra = sum(n for _, n in ordered) - num_seqs
        sampled_rows = len(rows.sampled) + len(rows.forks)
        seqs = next((size for size in self.mixed_seq_sizes if size >= max(num_seqs, sampled_rows)), None)
        tokens = next((size for size in self.mixed_extra_sizes if size >= extra), None)
        if seqs is None or tokens is None:
            return None
        if rows.verified and sampled_rows + sum(n for _, n in rows.verified) > self._verify_rows(seqs, seqs + tokens):
            return None
        return seqs, seqs + tokens

    def _verify_rows(self, num_seqs: int, num_tokens: int) -> int:
        """The logits rows a verification graph of this shape gathers: every sequence's and up to
        `verify_extra_tokens` draft rows."""
        return min(num_tokens, num_seqs + self.verify_extra_tokens)

    def _replay_mixed(self, batch: InputBatch, lora: LoRAStepContext | None, num_seqs: int,
                      num_tokens: int, staging: PinnedStaging | None = None,
                      feed_tokens: torch.Tensor | None = None) -> ForwardOutput:
        """`staging`, `feed_tokens`: as `_replay_decode`'s."""
        verify = batch.logit_rows.size > num_seqs  # draft rows' logits too
        key = (num_seqs, num_tokens, _mixed_kind(_lora_kind(lora), verify))
        self._forget_stale_lora_graphs()
        graph = self.mixed_graphs.get(key)
        if graph is None:
            self._capture_every_graph_of(lora)
            graph = self.mixed_graphs.get(key)
        if graph is None:
            graph = self.mixed_graphs[key] = self._capture_mixed(num_seqs, num_tokens, lora, verify=verify)
        cu = batch.cu_seqlens_q
        tables = np.zeros((num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        tables[: batch.num_seqs] = batch.block_tables
        (staging or self.staging).upload([
            _pad(batch.input_ids, num_tokens, 0), _pad(batch.positions, num_tokens, 0),
            _pad(batch.slot_mapping, num_tokens, -1), _pad(batch.seq_lens, num_seqs, 0),
            _pad(cu, num_seqs + 1, int(cu[-1])), _pad(batch.logit_rows, graph.logits.shape[0], 0), tables,
        ], target=graph.inputs)
        if feed_tokens is not None:
            _take_fed_ids(graph.inputs[:num_tokens], feed_tokens, every_row_fed=bool(batch.input_ids.min() >= 0))
        started = self.step_timer.begin()
        graph.replay_forward(graph_lora(lora))
        self.step_timer.end(started, "mixed_graph", num_tokens)
        self.num_mixed_graph_steps += 1
        self.last_graph = graph
        count = len(batch.logit_rows)
        hidden = self._graph_hidden()[: batch.num_tokens] if batch.prompt_logprob_spans else None
        return ForwardOutput(hidden, graph.logits[:count] if count else None, graph)

    def _capture_mixed(self, num_seqs: int, num_tokens: int, lora: LoRAStepContext | None,
                       verify: bool = False) -> DecodeGraph:
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return capture_mixed_graph(
            num_seqs=num_seqs, num_tokens=num_tokens, max_blocks_per_seq=self.max_blocks_per_seq,
            block_size=self.block_size, lora_batch=graph_lora(lora), masks=self.masks, draws=self.draws,
            step_forward=self._mixed_forward, logits=self._graph_logits(), pool=self._graph_pool,
            device=self.device, num_logit_rows=self._verify_rows(num_seqs, num_tokens) if verify else None,
            decode_splits=self._decode_splits(num_seqs),
        )

    def _mixed_forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: TritonAttentionMetadata,
                       lora: LoRAStepContext | None, logit_rows: torch.Tensor) -> torch.Tensor:
        cos, sin = self.model.rotary.cos_sin(positions)
        ctx = StepContext(attention=meta, cos=cos, sin=sin, backend=self.attention_backend, lora=lora)
        hidden = self.model(ids, ctx, self.kv_caches)
        self._graph_hidden()[: hidden.shape[0]].copy_(hidden)  # for prompt logprobs; ~1 us a step
        return self.model.compute_logits(hidden[logit_rows.long()])

    def padded_size(self, num_seqs: int) -> int:
        return next(size for size in self.ladder if size >= num_seqs)

    def _replay_decode(self, batch: InputBatch, lora: LoRAStepContext | None, staging: PinnedStaging | None = None,
                       feed_tokens: torch.Tensor | None = None) -> DecodeGraph:
        """`feed_tokens`: `batch.input_ids` name rows of this device tensor or known tokens (`_feed_input_ids`)."""
        size = batch.block_tables.shape[0]
        key = (size, _lora_kind(lora))  # one LoRA graph per size and set of adapted linears: the stacks are fixed
        self._forget_stale_lora_graphs()
        graph = self.graphs.get(key)
        if graph is None:
            self._capture_every_graph_of(lora)
            graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(size, lora)
        (staging or self.staging).upload([batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens,
                                          batch.block_tables], target=graph.inputs)
        if feed_tokens is not None:
            _take_fed_ids(graph.inputs[:size], feed_tokens, every_row_fed=bool(batch.input_ids.min() >= 0))
        started = self.step_timer.begin()
        graph.replay_forward(graph_lora(lora))
        self.step_timer.end(started, "decode_graph", size)
        self.num_graph_steps += 1
        self.last_graph = graph
        return graph

    def _capture(self, size: int, lora: LoRAStepContext | None) -> DecodeGraph:
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return capture_decode_graph(
            batch_size=size, max_blocks_per_seq=self.max_blocks_per_seq, block_size=self.block_size,
            num_splits=self._decode_splits(size), lora_batch=graph_lora(lora), masks=self.masks, draws=self.draws,
            step_forward=self._step_forward, logits=self._graph_logits()[:size], pool=self._graph_pool,
            device=self.device,
        )

    def _graph_logits(self) -> torch.Tensor:
        """Every graph's logits: one buffer (graphs replay one at a time), a row per decode-graph row, or per
        token of the largest verification graph."""
        if self._shared_logits is None:
            rows = self.ladder[-1]
            if self.verify_extra_tokens:
                rows = max([rows, *(self._verify_rows(s, t) for s, t in self.mixed_shapes())])
            self._shared_logits = torch.empty(rows, self.vocab_size, dtype=torch.float32, device=self.device)
        return self._shared_logits

    def _graph_hidden(self) -> torch.Tensor:
        """Every mixed graph's hidden states, one buffer (graphs replay one at a time), a row per token of the
        largest mixed graph."""
        if self._shared_hidden is None:
            rows = max(tokens for _, tokens in self.mixed_shapes())
            self._shared_hidden = torch.empty(rows, self.hidden_size, dtype=self.model.embed_tokens.weight.dtype,
                                              device=self.device)
        return self._shared_hidden

    def _step_forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: TritonAttentionMetadata,
                      lora: LoRAStepContext | None) -> torch.Tensor:
        cos, sin = self.model.rotary.cos_sin(positions)
        ctx = StepContext(attention=meta, cos=cos, sin=sin, backend=self.attention_backend, lora=lora)
        return self.model.compute_logits(self.model(ids, ctx, self.kv_caches))

    def _decode_splits(self, padded_size: int) -> int:
        return choose_num_splits(padded_size, self.num_kv_heads, self.max_blocks_per_seq * self.block_size,
                                 self.device, self.head_dim)

    # ---- eager forward (prefill chunks, mixed steps, graphs off) --------------------------
    def _forward_eager(self, batch: InputBatch, lora: LoRAStepContext | None) -> ForwardOutput:
        num_seqs, width = batch.num_seqs, batch.block_tables.shape[1]
        ids_d, pos_d, slots_d, lens_d, cu_d, tables_d, rows_d = self.staging.upload([
            batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens, batch.cu_seqlens_q,
            batch.block_tables, batch.logit_rows,
        ])
        decode_only = batch.is_decode_only
        new_tokens = np.diff(batch.cu_seqlens_q)
        meta = TritonAttentionMetadata(
            block_size=self.block_size, slot_mapping=slots_d, block_tables=tables_d.view(num_seqs, width),
            seq_lens=lens_d, cu_seqlens_q=None if decode_only else cu_d,
            num_splits=self._decode_splits(self.padded_size(num_seqs) if decode_only else num_seqs),
            decodes_apart=not decode_only and bool((new_tokens == 1).any()),
        )
        cos, sin = self.model.rotary.cos_sin(pos_d)
        ctx = StepContext(attention=meta, cos=cos, sin=sin, backend=self.attention_backend, lora=lora)
        started = self.step_timer.begin()
        hidden = self.model(ids_d, ctx, self.kv_caches)
        self.step_timer.end(started, "eager", 1 << (batch.num_tokens - 1).bit_length())  # a power of 2
        self.num_eager_steps += 1
        if not batch.logit_rows.size:
            return ForwardOutput(hidden, None)
        return ForwardOutput(hidden, self.model.compute_logits(hidden[rows_d.long()]).float())


def _lora_kind(lora: LoRAStepContext | None) -> str | None:
    """The LoRA part of a graph's key: None (no adapter rows), "lora" (LoRA kernels at every linear) or
    "lora:<linears>" (only at the linears some resident adapter adapts, `LoRASlotPool.adapted_signature`)."""
    if lora is None:
        return None
    signature = getattr(lora, "signature", EVERY_LINEAR)
    return "lora" if signature == EVERY_LINEAR else f"lora:{signature}"


def _mixed_kind(lora_kind: str | None, verify: bool) -> str | None:
    """A mixed graph's kind: the base model's (None) or LoRA rows' (`_lora_kind`), gathering one logits row per
    sequence or, to verify drafts, draft rows' too."""
    return "+".join(name for name in (lora_kind, "verify" if verify else None) if name) or None


def _feed_input_ids(batch: InputBatch, decodes: list[Sequence], row_of: dict[int, int]) -> None:
    """The input ids of a step launched ahead of the one in flight, as the host sends them: a decode in flight
    (its last token a placeholder) as the row of the in-flight step's tokens to read (>= 0), every other token
    id t as -(t + 1); graph padding stays 0 (it reads row 0, and writes nothing). Decodes are the batch's first
    rows, one token each."""
    ids = batch.input_ids
    real = ids[: int(batch.query_lens[: batch.num_seqs].sum())]
    np.negative(real, out=real)
    real -= 1
    for i, seq in enumerate(decodes):
        row = row_of.get(seq.seq_id)
        if row is not None:
            ids[i] = row


def _take_fed_ids(ids: torch.Tensor, feed_tokens: torch.Tensor, every_row_fed: bool) -> None:
    """Decode `_feed_input_ids` on the device, in place: rows of `feed_tokens`, or the tokens sent.
    `every_row_fed` (no id sent as itself: the common step of decodes alone): one gather."""
    if every_row_fed:
        ids.copy_(feed_tokens.index_select(0, ids.long()))
        return
    fed = feed_tokens.index_select(0, ids.clamp(min=0).long())
    ids.copy_(torch.where(ids >= 0, fed, -ids.long() - 1))


def _pad(values: np.ndarray, size: int, fill: int) -> np.ndarray:
    """`values` followed by `fill` up to `size` entries (a graph's static input)."""
    out = np.full(size, fill, dtype=np.int32)
    out[: values.size] = values
    return out
