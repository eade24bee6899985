"""Model and engine configuration.

`ModelConfig` is read from a Hugging Face `config.json` (Llama, Mistral,
Qwen2, Qwen3, SmolLM2); `EngineConfig` holds the serving knobs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.engine.spec.policy import SpeculationConfig

if TYPE_CHECKING:  # annotations only: the supervisor and the API servers' engine client import this without torch
    import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Below this many bytes of weights a GPU, a decode step is bound by the host's work rather than by reading the
# weights (~1.5-2 ms of Python a step at 64 rows against ~0.8 ms to read 4 GiB on an H200); batch work beside
# interactive work is then admitted in few, larger steps (EngineConfig.resolve_batch_prefill_tokens_beside_interactive)
HOST_BOUND_WEIGHT_BYTES = 4 << 30


def steps_bound_by_the_host(weight_bytes_per_gpu: int) -> bool:
    return weight_bytes_per_gpu < HOST_BOUND_WEIGHT_BYTES


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        num_heads = raw["num_attention_heads"]
        # transformers 5 keeps theta and scaling in `rope_parameters`; older configs
        # use `rope_theta` + `rope_scaling`.
        rope_params = dict(raw.get("rope_parameters") or {})
        rope_scaling = raw.get("rope_scaling") or None
        theta = rope_params.pop("rope_theta", raw.get("rope_theta", 10000.0))
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        qkv_bias = bool(raw.get("attention_bias", model_type == "qwen2"))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=model_type == "qwen3",
            hidden_act=raw.get("hidden_act", "silu"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        return cls.from_hf_dict(json.loads((Path(model_dir) / "config.json").read_text()))


# dtype name -> bytes an element (the KV sizing needs no torch: this module is imported where torch is not)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    kv_cache_bytes: int = 256 * 1024 * 1024  # memory budget for the KV pool
    num_blocks: int | None = None            # overrides the budget (tests use tiny pools)
    max_num_batched_tokens: int = 512        # per-step token budget (prefill chunks + decodes)
    max_num_seqs: int = 64
    max_model_len: int | None = None         # None: the model's max_position_embeddings
    dtype: str = "float32"
    device: str = "cpu"
    enable_prefix_caching: bool = True
    # CUDA runner (engine/cuda): the KV pool takes this fraction of the GPU's memory, less the
    # weights and a profiled forward's peak, unless num_blocks is given; decode steps replay
    # CUDA graphs for batch sizes up to running_slots() unless enable_cuda_graphs is False; with
    # cuda_graph_mixed_steps, steps that mix prefill chunks with decodes replay graphs too (engine/cuda/graphs.py).
    gpu_memory_utilization: float = 0.9
    enable_cuda_graphs: bool = True
    cuda_graph_mixed_steps: bool = True
    host_kv_bytes: int = 0                   # host memory for offloaded session KV; 0: no host tier (drop)
    num_host_blocks: int | None = None       # overrides host_kv_bytes
    # Session pin budgets (device blocks): past them the least recently used pins (of that tenant, or of
    # anyone) are offloaded; a session larger than a budget is not pinned. None: the pool is the limit.
    max_pinned_blocks: int | None = None
    max_pinned_blocks_per_tenant: int | float | None = None  # a float: that share of the pool's blocks
    # Grammar-forced tokens (keys, punctuation, the close near max_tokens) are appended without a
    # sampling step and prefilled together (jump-forward); the output is the same either way.
    grammar_jump_forward: bool = True
    # Tensor parallelism: the model is split over this many GPUs, one worker process each
    # (engine/parallel); the KV pool and every budget above are per rank.
    tensor_parallel_size: int = 1
    # Small all-reduces under tensor parallelism in one kernel over symmetric (peer-mapped) memory
    # where the machine supports it; False: NCCL for every all-reduce
    tp_one_shot_all_reduce: bool = True
    # Launch each plain decode step (greedy, or drawing at a temperature alone) before the previous one's tokens are
    # read back, so the host schedules and updates outputs while the GPU runs (engine/step_overlap.py); same outputs.
    # None: on on CUDA, off on the CPU (whose runner runs a launched step at once: nothing to overlap)
    overlap_scheduling: bool | None = None
    # A long decode sits out two steps of three for a much shorter sequence of another tenant
    # (engine/scheduler.py); None: on (16 tokens) on the CPU, where a step's cost grows with its batch,
    # off on CUDA, where it barely does; 0: off.
    decode_yield_min_tokens: int | None = None
    # Weighted fair shares of running slots, KV blocks and prefill tokens between tenants, with preemption of
    # the tenant furthest over its share when one under its share waits (engine/fair_share.py)
    fair_sharing: bool = True
    # With fair sharing, the engine runs this many slots beyond max_num_seqs, kept for a tenant under its share
    # (as if one more tenant came): one tenant's flood fills max_num_seqs, never the engine, and another's request
    # starts without a preemption (engine/scheduler.py); None: max_num_seqs // 32 (2 of 64; 0 below 32 slots).
    newcomer_reserved_slots: int | None = None
    # Where mixed steps replay graphs: a flood sits out the step admitting another tenant's prompt of at most this
    # many tokens (engine/scheduler.py, _floods_sitting_out_for_a_prefill); 0: never
    flood_sit_out_prompt_tokens: int = 0
    # While interactive work runs or waits, batch work runs at most this many rows a step (engine/scheduler.py,
    # _batch_rows_allowance); 0: no limit. The CPU (decode yielding on) runs no batch row beside interactive work.
    batch_rows_beside_interactive: int = 0
    # While interactive work runs or waits, batch work is admitted once this share of its room is free, in waves
    # (engine/scheduler.py, _batch_admission_waits_for_a_wave); 0: whenever a slot is free; None: by the model's
    # size (resolve_batch_admission_wave). The CPU admits no batch line beside interactive work.
    batch_admission_wave: float | None = None
    # While interactive work runs or waits, a step runs at most this many batch prompt tokens, and an admission
    # wave stays open over steps until its room is filled (engine/scheduler.py, _batch_prefill_chunk); 0: the
    # step's budget; None: by the model's size (resolve_batch_prefill_tokens_beside_interactive). The CPU admits
    # no batch line beside interactive work.
    batch_prefill_tokens_beside_interactive: int | None = None
    # Speculative decoding (engine/spec): off | ngram (decodes draft up to speculative_num_tokens tokens by
    # prompt lookup, n-grams of speculative_ngram_min..max tokens) | auto (the same, switched off per
    # sequence where drafts are mostly rejected and per step where the batch is compute-bound)
    speculative_decoding: str = "off"
    speculative_num_tokens: int = 4
    speculative_ngram_min: int = 2
    speculative_ngram_max: int = 4

    def speculation(self, max_model_len: int) -> SpeculationConfig:
        return SpeculationConfig(self.speculative_decoding, self.speculative_num_tokens, self.speculative_ngram_min,
                                 self.speculative_ngram_max, self.device.partition(":")[0], max_model_len)

    def resolve_decode_yield_min_tokens(self) -> int:
        if self.decode_yield_min_tokens is not None:
            return self.decode_yield_min_tokens
        return 16 if self.device == "cpu" else 0

    def resolve_overlap_scheduling(self) -> bool:
        if self.overlap_scheduling is not None:
            return self.overlap_scheduling
        return self.device.startswith("cuda")

    def resolve_batch_admission_wave(self, weight_bytes_per_gpu: int) -> float:
        if self.batch_admission_wave is not None:
            return self.batch_admission_wave
        return 0.5 if steps_bound_by_the_host(weight_bytes_per_gpu) else 0.25

    def resolve_batch_prefill_tokens_beside_interactive(self, weight_bytes_per_gpu: int) -> int:
        """Batch prompt tokens a step beside interactive work. Where a decode step reads many weights its GPU
        time is what an interactive request waits for, and each prompt token adds to it: prompts spread thin
        (32 tokens a step; Llama-3.1-8B's shapes on an H200: the interactive p95 1.46x quiet against 1.52x at
        64). Where it reads few, a step is bound by the host's work, which each step that carries prompts adds
        to whatever its tokens: prompts come in few steps, uncapped, in waves of half the room (SmolLM2-135M's
        shapes on an H200: 32 tokens a step made the p95 2.68x and the batch beside it 0.86x of alone)."""
        if self.batch_prefill_tokens_beside_interactive is not None:
            return self.batch_prefill_tokens_beside_interactive
        return 0 if steps_bound_by_the_host(weight_bytes_per_gpu) else 32

    def mixed_steps_replay_graphs(self) -> bool:
        """Whether steps with prefill chunks replay captured graphs (CUDA, one rank): then they cost about what a
        decode step costs, and nobody needs to sit them out."""
        return (self.device.startswith("cuda") and self.enable_cuda_graphs and self.cuda_graph_mixed_steps
                and self.tensor_parallel_size == 1)

    def running_slots(self) -> int:
        """The most sequences a step runs: max_num_seqs, and with fair sharing the slots kept for newcomers on top.

        On top, not within: kept within, they held a closed flood of max_num_seqs streams two short, and those two
        ran alone after the rest, doubling the flood's time (~2,000 steps instead of ~1,000 for 64 streams of 1,000
        tokens on an H200, its tokens/s 0.75x of fair sharing off)."""
        return self.max_num_seqs + (self.resolve_newcomer_reserved_slots() if self.fair_sharing else 0)

    def resolve_newcomer_reserved_slots(self) -> int:
        if self.newcomer_reserved_slots is not None:
            return min(self.newcomer_reserved_slots, self.max_num_seqs - 1)
        return self.max_num_seqs // 32

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    def resolve_max_model_len(self, model: ModelConfig) -> int:
        return self.max_model_len or model.max_position_embeddings

    def resolve_num_blocks(self, model: ModelConfig) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return max(1, self.kv_cache_bytes // self.bytes_per_block(model))

    def resolve_num_host_blocks(self, model: ModelConfig) -> int:
        if self.num_host_blocks is not None:
            return self.num_host_blocks
        return self.host_kv_bytes // self.bytes_per_block(model)

    def bytes_per_block(self, model: ModelConfig) -> int:
        element = _DTYPE_BYTES[self.dtype]
        kv_heads_per_rank = max(1, model.num_key_value_heads // self.tensor_parallel_size)
        per_block = 2 * model.num_hidden_layers * self.block_size * kv_heads_per_rank
        return per_block * model.head_dim * element


@dataclass(frozen=True, slots=True)
class AdapterLimits:
    """How many LoRA adapters the engine keeps where (the platform's settings of the same names)."""

    max_loras: int = 8        # resident in device slots at once
    max_cpu_loras: int = 32   # kept in host memory
    max_lora_rank: int = 64
    load_retry_base_s: float = 1.0   # a failed load is retried after this, doubling up to load_retry_max_s
    load_retry_max_s: float = 60.0
