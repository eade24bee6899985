"""Triton multi-LoRA ops: shrink (x @ A.T), expand (y += scale * s @ B.T), and both fused.

One kernel (``lora_triton_programs.lora_kernel``) serves all of them. Its programs come
in two ranges of ``program_id``:

- shrink programs, one per (tile, K split): a tile is up to ``block_m`` tokens of one slot
  (``lora_metadata``); each reads its K slice of those tokens' x rows and of the slot's A
  rows of every slice of the layer, up to each slice's rank, and writes float32 partials;
- expand programs, one per (tile, BLOCK_N columns of one output slice): each reads the
  slot's B columns and the y tile, sums the tile's partials, and adds the product into y.

``add_lora`` runs both ranges in one launch (``fused``) or in two. Fused, the expand
programs come after every shrink program in launch order, prefetch B and y, then wait
on the tile's counter. Waiting only on programs with lower ids is the "decoupled
look-back" pattern: those were dispatched first, so they make progress. The last expand
program of a tile past the wait zeroes its counters, so ``meta.sync`` is zero again for
the next layer. Two launches need no counters at all: the kernel boundary orders them.
Grids depend on (num_tokens, max_loras, block_m) and the layer's shapes, never on the
batch's content, and nothing syncs with the host: CUDA-graph safe.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch
import triton
from loraplex.engine.kernels.lora_metadata import LoRAMetadata
from loraplex.engine.kernels.lora_triton_programs import lora_kernel
from loraplex.engine.kernels.lora_weights import LoRAStack


@dataclass(frozen=True, slots=True)
class LoRAKernelConfig:
    block_n: int  # output columns per expand program
    split_k: int  # input features per shrink program
    block_k: int  # input features per shrink loop step
    num_warps: int
    fused: bool = True  # one launch; False runs shrink then expand (two launches)
    num_stages: int = 3
    # True: A rows / B columns past a slot's rank move no bytes, but those loads wait for the
    # rank; False: no wait, padding read then dropped (prefill, where A and B bytes are few).
    rank_masked_loads: bool = True


def choose_config(stack: LoRAStack, meta: LoRAMetadata) -> LoRAKernelConfig:
    """From the H100 sweep in benchmarks/notes/lora_kernels.md.

    Decode-sized batches are latency-bound: one launch, short K splits for many programs in
    flight. Prefill chunks are bandwidth-bound: two launches, so expand programs never
    occupy an SM while they wait, and long K splits, so expand re-reads few partials.
    """
    rank_cols = triton.next_power_of_2(stack.num_slices * rank_pad(stack.max_rank))
    block_k = 64 if rank_cols * meta.block_m > 64 * 64 else 128
    if meta.num_tokens > 256:
        split_k = 2048 if stack.in_features >= 4096 else 1024
        return LoRAKernelConfig(block_n=256, split_k=max(block_k, split_k), block_k=block_k, num_warps=4,
                                fused=False, rank_masked_loads=False)
    # Each expand program re-reads K_SPLITS x BLOCK_M x rank_cols partials: wide ranks want fewer splits.
    short_split = rank_cols < 64 and (meta.num_tokens <= 16 or stack.in_features <= 2048)
    return LoRAKernelConfig(block_n=256, split_k=256 if short_split else 512, block_k=block_k, num_warps=4)


def rank_pad(max_rank: int) -> int:
    return max(16, triton.next_power_of_2(max_rank))  # tl.dot needs every dimension >= 16


def _launch(
    *,
    x: torch.Tensor | None,
    y: torch.Tensor | None,
    mid: torch.Tensor,
    stack: LoRAStack,
    meta: LoRAMetadata,
    config: LoRAKernelConfig,
    do_shrink: bool,
    do_expand: bool,
    token_io: bool,
) -> None:
    sizes = (*stack.out_sizes, 0, 0)[:3]
    tiles = [triton.cdiv(size, config.block_n) for size in sizes]
    r_pad = rank_pad(stack.max_rank)
    k_splits = triton.cdiv(stack.in_features, config.split_k)
    max_tiles = meta.max_tiles
    grid = (max_tiles * k_splits * do_shrink + max_tiles * sum(tiles) * do_expand,)
    x_arg = x if x is not None else mid
    y_arg = y if y is not None else mid
    lora_kernel[grid](
        x_arg, y_arg, stack.lora_a, stack.lora_b, stack.ranks, stack.scalings, mid, meta.sync, meta.tile_table,
        max_tiles, stack.in_features, x_arg.stride(0), y_arg.stride(0),
        mid.stride(0) if token_io else 0, stack.max_rank,
        stack.lora_a.stride(0), stack.lora_a.stride(1), stack.lora_a.stride(2),
        stack.lora_b.stride(0), stack.lora_b.stride(1),
        NUM_SLICES=stack.num_slices, OUT0=sizes[0], OUT1=sizes[1], OUT2=sizes[2],
        TILES0=tiles[0], TILES1=tiles[1], N_TILES=sum(tiles),
        R_PAD=r_pad, RANK_COLS=triton.next_power_of_2(stack.num_slices * r_pad),
        BLOCK_M=meta.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=config.split_k, K_SPLITS=k_splits,
        DO_SHRINK=do_shrink, DO_EXPAND=do_expand, TOKEN_IO=token_io,
        PTX=mid.is_cuda,  # the interpreter runs programs one by one and has no inline PTX
        INPUT_PRECISION="ieee" if stack.lora_a.dtype == torch.float32 else None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        RANK_MASKED_LOADS=config.rank_masked_loads,
        R_MAX=stack.max_rank,
    )


def _partials(stack: LoRAStack, meta: LoRAMetadata, config: LoRAKernelConfig, device: torch.device) -> torch.Tensor:
    rank_cols = triton.next_power_of_2(stack.num_slices * rank_pad(stack.max_rank))
    k_splits = triton.cdiv(stack.in_features, config.split_k)
    return torch.empty(meta.max_tiles * k_splits * meta.block_m * rank_cols, dtype=torch.float32, device=device)


def _check_rows(x: torch.Tensor, meta: LoRAMetadata) -> None:
    if x.shape[0] != meta.num_tokens or x.stride(-1) != 1:
        raise ValueError(f"expected {meta.num_tokens} rows with contiguous features, got {tuple(x.shape)}")


def lora_shrink(
    x: torch.Tensor, stack: LoRAStack, meta: LoRAMetadata, *, config: LoRAKernelConfig | None = None
) -> torch.Tensor:
    """[T, num_slices * max_rank] float32 = x @ A.T per token's slot; zero where no adapter or past rank."""
    _check_rows(x, meta)
    config = config or choose_config(stack, meta)
    one_split = dataclasses.replace(config, split_k=triton.cdiv(stack.in_features, config.block_k) * config.block_k)
    shrunk = torch.zeros(meta.num_tokens, stack.num_slices * stack.max_rank, dtype=torch.float32, device=x.device)
    _launch(x=x, y=None, mid=shrunk, stack=stack, meta=meta, config=one_split, do_shrink=True, do_expand=False,
            token_io=True)
    return shrunk


def lora_expand(
    shrunk: torch.Tensor,
    y: torch.Tensor,
    stack: LoRAStack,
    meta: LoRAMetadata,
    *,
    config: LoRAKernelConfig | None = None,
) -> None:
    """y[:, slice i] += scaling * shrunk[:, slice i] @ B_i.T in place, for rows with an adapter."""
    _check_rows(y, meta)
    _check_rows(shrunk, meta)
    config = config or choose_config(stack, meta)
    _launch(x=None, y=y, mid=shrunk, stack=stack, meta=meta, config=config, do_shrink=False, do_expand=True,
            token_io=True)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    stack: LoRAStack,
    meta: LoRAMetadata,
    *,
    config: LoRAKernelConfig | None = None,
) -> None:
    """y += LoRA delta of x for every slice of the layer, each token through its slot's adapter."""
    _check_rows(x, meta)
    _check_rows(y, meta)
    config = config or choose_config(stack, meta)
    partials = _partials(stack, meta, config, x.device)
    launch = partial(_launch, mid=partials, stack=stack, meta=meta, config=config, token_io=False)
    if config.fused:
        launch(x=x, y=y, do_shrink=True, do_expand=True)
    else:
        launch(x=x, y=None, do_shrink=True, do_expand=False)
        launch(x=None, y=y, do_shrink=False, do_expand=True)
