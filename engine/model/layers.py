"""Building blocks of the Llama family: RMSNorm, rotary embedding, and the
one LoRA-ready linear layer every adaptable projection goes through."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from loraplex.engine.parallel.group import SINGLE_RANK, TensorParallelGroup
from torch import nn

# y = x @ weight.T (+ bias): F.linear, or a kernel the CUDA runner installs in its place
LinearOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

if TYPE_CHECKING:
    from loraplex.engine.context import StepContext


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x); with `residual`: s = x + residual (rounded to the dtype, as `hidden + out`
        would be), returns (RMSNorm(s), s). The CUDA runner's twin does the pair in one kernel."""
        if residual is not None:
            total = x + residual
            return self._norm(total), total
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; the same arithmetic as below without casts
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SiluAndMul(nn.Module):
    """[T, 2n] (gate columns, then up) -> silu(gate) * up; the CUDA runner swaps in one kernel."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with cos/sin precomputed for every position."""

    cos: torch.Tensor  # buffers: [max_positions, head_dim]
    sin: torch.Tensor

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(positions, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> ([T, 1, head_dim], [T, 1, head_dim]), computed once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class LoRALinear(nn.Module):
    """A linear layer that LoRA adapters can target, possibly several projections merged.

    The output is the concatenation of named slices (e.g. q_proj, k_proj,
    v_proj merged into one matmul); `slices` is a tuple of
    `(module_name, out_start, out_end)` in output columns, and
    `layer_index` is the decoder layer this projection belongs to.

    Under tensor parallelism the sizes given are this rank's: `parallel="column"` layers
    output their rank's rows and need no collective; `parallel="row"` layers produce a
    partial sum that is all-reduced after the LoRA delta is added (the delta is partial in
    the same way, see `engine/parallel/plan.py`), so adapters cost no extra collective.

    LoRA hook contract: after computing the base output `y = x @ W.T (+ b)`,
    if `ctx.lora is not None` the layer calls
    `ctx.lora.apply(x, y, layer_index, slices)`, which must add each slice's
    LoRA delta into `y[:, out_start:out_end]` in place. `x` is `[tokens, in]`
    with tokens in the step's batch order (the same order the runner passed
    to its `lora.build(...)`). With `ctx.lora is None` (the default) no
    adapter code runs at all. A context may also offer `fused_linear(x, weight,
    bias, layer_index, slices)`, returning the base output with the delta already
    added (one launch at decode) or None, in which case the two steps above run.
    """

    def __init__(
        self,
        in_features: int,
        out_slices: list[tuple[str, int]],
        layer_index: int,
        bias: bool = False,
        parallel: str | None = None,
        tp: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        if parallel == "row" and bias:
            raise ValueError("a row-parallel linear would add its bias once per rank")
        self.parallel = parallel
        self.tp = tp
        slices = []
        start = 0
        for name, size in out_slices:
            slices.append((name, start, start + size))
            start += size
        self.slices: tuple[tuple[str, int, int], ...] = tuple(slices)
        self.layer_index = layer_index
        self.in_features = in_features
        self.out_features = start
        self.weight = nn.Parameter(torch.empty(start, in_features))
        self.bias = nn.Parameter(torch.zeros(start)) if bias else None

    # y = x @ W.T (+ b); the CUDA runner installs a batch-1 GEMV (`engine/cuda/gemv.py`) per instance
    matmul: LinearOp = staticmethod(F.linear)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        begin = getattr(ctx.lora, "begin", None) if not self.tp.is_parallel else None
        if begin is not None:  # the CUDA runner's LoRA work beside the GEMM (`engine/cuda/lora_overlap.py`)
            pending = begin(x, self.layer_index, self.slices, self.out_features)
            out = self.matmul(x, self.weight, self.bias)
            if pending is not None:
                pending.finish(out)
            return out
        fused = getattr(ctx.lora, "fused_linear", None)
        y = fused(x, self.weight, self.bias, self.layer_index, self.slices) if fused is not None else None
        if y is None:  # no adapter for this linear, or not a decode-sized batch on the GPU
            y = self.matmul(x, self.weight, self.bias)
            if ctx.lora is not None:
                ctx.lora.apply(x, y, self.layer_index, self.slices)
        if self.parallel == "row":
            self.tp.all_reduce_(y)
        return y

    def slice_of(self, module_name: str) -> tuple[int, int]:
        for name, start, end in self.slices:
            if name == module_name:
                return start, end
        raise KeyError(module_name)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with this rank's `ceil(vocab / ranks)` rows; other ranks' tokens embed
    to zero here and the all-reduce brings them in. One rank: a plain embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.tp = tp
        self.rows = -(-vocab_size // tp.world_size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce_(out)


# On the CPU, F.linear with a handful of rows takes a slow GEMM path for a tall weight: SmolLM2's 49152x576
# head costs ~2.5x as much for 2-16 rows as for one (measured on 2 cores), so each extra sequence in a decode
# batch nearly doubled the step. W @ x.T computes the same dot products (equal to rounding) at the one-row
# cost up to a few dozen rows; from ~128 rows the plain path is as fast again.
_CPU_HEAD_TRANSPOSED_ROWS = range(2, 97)


def _cpu_small_batch_head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    if weight.device.type != "cpu" or hidden.dim() != 2 or hidden.shape[0] not in _CPU_HEAD_TRANSPOSED_ROWS:
        return None
    return torch.mm(weight, hidden.t()).t().contiguous()


def store_linears_column_major(model: nn.Module) -> None:
    """Keep each linear's weight as the same [out, in] tensor laid out column by column, for the CPU's GEMM.

    F.linear then multiplies by a contiguous [in, out] matrix, for which MKL's kernels with 4 to ~128 rows are
    much faster than for the row-major weight a checkpoint gives: over SmolLM2's 30 layers (one core, weights
    streamed from memory) 0.71-0.83x the time at 4-12 rows, which a speculative verification row (1 + drafts)
    or a small decode batch is, 0.75-0.9x at 32-128 and 0.92x at one row; 1.04-1.06x at 2-3 rows. Values are
    unchanged (a copy), so is every shape; converting twice is a no-op, which keeps engines sharing one model
    copy (tests) from copying again. The tall head has its own small-batch path (`_cpu_small_batch_head`) and
    stays row-major, as the embedding it is tied to wants."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear) and module.weight.device.type == "cpu" and module.weight.is_contiguous():
                module.weight.data = module.weight.data.t().contiguous().t()


class VocabParallelHead(nn.Module):
    """LM head with this rank's vocabulary rows; logits are all-gathered, padding columns cut."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(-(-vocab_size // tp.world_size), hidden_size))

    matmul: LinearOp = staticmethod(F.linear)  # as LoRALinear.matmul

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = _cpu_small_batch_head(hidden, self.weight)
        if logits is None:
            logits = self.matmul(hidden, self.weight, None)
        if not self.tp.is_parallel:
            return logits
        return self.tp.all_gather_last(logits)[..., : self.vocab_size]
