"""Per-step LoRA batch metadata: built once on the host per step, shared by every layer.

Three views of one batch:

- token view (BGMV): ``token_slots[t]`` is the adapter slot of token t, -1 for the base model;
- group view (SGMV): tokens with an adapter, stably sorted by slot, in ``sorted_token_ids``;
  one group per active slot (``group_slots`` ascending, ``group_starts``/``group_lens`` index
  ``sorted_token_ids``). A prefill of contiguous segments and a decode batch of one slot
  per token both become this: sorting decode tokens by slot lets a kernel read each
  adapter's weights once per group instead of once per token;
- tile view (what the kernels launch over): every group cut into tiles of at most
  ``block_m`` tokens of one slot. ``tile_table`` row i is [slot, token ids..., -1 padding]:
  a kernel program reads its slot and its tokens in one memory round trip.

Every tensor has a size fixed by (num_tokens, max_loras, block_m) alone, padded with
slot -1 (programs on a padding tile exit at once), so a CUDA graph captured for one
batch size replays for any content: copy a fresh metadata into the captured one with
``copy_``. ``sync`` is the kernels' per-tile counter workspace; they leave it zeroed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Counters past the tile counters: `lora_gemm`'s shrink counter and ticket, then one per output block of a
# split-K GEMM (blocks past this many run without splits).
SYNC_EXTRA = 2 + 2048


def default_block_m(num_tokens: int) -> int:
    """Tile height: small for decode (few tokens per adapter), larger for prefill chunks."""
    return 16 if num_tokens <= 256 else 32


def max_tiles_for(num_tokens: int, max_loras: int, block_m: int) -> int:
    # Each active slot's group adds at most one partially filled tile.
    return -(-num_tokens // block_m) + min(num_tokens, max_loras)


@dataclass(slots=True)
class LoRAMetadata:
    num_tokens: int
    max_loras: int
    block_m: int
    max_tiles: int
    packed: torch.Tensor  # int32, every view below lives in it (one host-to-device copy)
    token_slots: torch.Tensor  # [num_tokens]
    sorted_token_ids: torch.Tensor  # [num_tokens]; entries past the last group are 0
    group_slots: torch.Tensor  # [min(num_tokens, max_loras)], -1 padded
    group_starts: torch.Tensor
    group_lens: torch.Tensor
    tile_table: torch.Tensor  # [max_tiles, 1 + block_m]: slot (-1 = padding tile), then tokens (-1 = none)
    sync: torch.Tensor  # int32 [2 * max_tiles + SYNC_EXTRA], zero between launches

    def copy_(self, other: LoRAMetadata) -> None:
        """Refill a captured (static) metadata with another step's content of the same shape."""
        if (self.num_tokens, self.max_loras, self.block_m) != (other.num_tokens, other.max_loras, other.block_m):
            raise ValueError("metadata shapes differ; capture a graph per (num_tokens, max_loras, block_m)")
        self.packed.copy_(other.packed, non_blocking=True)


def build_lora_metadata(
    token_slots: Sequence[int] | np.ndarray | torch.Tensor,
    *,
    max_loras: int,
    device: torch.device | str,
    block_m: int | None = None,
) -> LoRAMetadata:
    """Metadata for a batch given each token's slot (-1: no adapter). Host work, O(T log T)."""
    slots = np.asarray(
        token_slots.cpu().numpy() if isinstance(token_slots, torch.Tensor) else token_slots, dtype=np.int64
    ).reshape(-1)
    num_tokens = int(slots.shape[0])
    if num_tokens == 0:
        raise ValueError("a LoRA batch needs at least one token")
    if slots.max() >= max_loras or slots.min() < -1:
        raise ValueError(f"token slots must lie in [-1, {max_loras})")
    block_m = block_m or default_block_m(num_tokens)
    max_groups = min(num_tokens, max_loras)
    max_tiles = max_tiles_for(num_tokens, max_loras, block_m)

    adapted = np.flatnonzero(slots >= 0)
    order = adapted[np.argsort(slots[adapted], kind="stable")]
    group_slots, group_starts, group_lens = np.unique(slots[order], return_index=True, return_counts=True)

    tiles_per_group = -(-group_lens // block_m)
    tile_group = np.repeat(np.arange(len(group_slots)), tiles_per_group)
    first_tile = np.cumsum(tiles_per_group) - tiles_per_group
    tile_offset = (np.arange(len(tile_group)) - first_tile[tile_group]) * block_m
    tile_starts = group_starts[tile_group] + tile_offset
    tile_lens = np.minimum(block_m, group_lens[tile_group] - tile_offset)

    sizes = [num_tokens, num_tokens, max_groups, max_groups, max_groups, max_tiles * (1 + block_m)]
    host = np.zeros(sum(sizes), dtype=np.int32)
    parts = np.split(host, np.cumsum(sizes)[:-1])
    parts[0][:] = slots
    parts[1][: len(order)] = order
    for part, values, pad in ((parts[2], group_slots, -1), (parts[3], group_starts, 0), (parts[4], group_lens, 0)):
        part[:] = pad
        part[: len(values)] = values
    table = parts[5].reshape(max_tiles, 1 + block_m)
    table[:] = -1
    table[: len(tile_group), 0] = group_slots[tile_group]
    offsets = np.arange(block_m)
    in_tile = offsets[None, :] < tile_lens[:, None]
    positions = np.where(in_tile, tile_starts[:, None] + offsets[None, :], 0)
    table[: len(tile_group), 1:] = np.where(in_tile, order[positions] if len(order) else 0, -1)

    packed_host = torch.from_numpy(host)
    device = torch.device(device)
    packed = packed_host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else packed_host
    views = torch.split(packed, sizes)
    return LoRAMetadata(
        num_tokens=num_tokens,
        max_loras=max_loras,
        block_m=block_m,
        max_tiles=max_tiles,
        packed=packed,
        token_slots=views[0],
        sorted_token_ids=views[1],
        group_slots=views[2],
        group_starts=views[3],
        group_lens=views[4],
        tile_table=views[5].view(max_tiles, 1 + block_m),
        sync=torch.zeros(2 * max_tiles + SYNC_EXTRA, dtype=torch.int32, device=device),
    )


def build_lora_metadata_for_segments(
    segment_lens: Sequence[int],
    segment_slots: Sequence[int],
    *,
    max_loras: int,
    device: torch.device | str,
    block_m: int | None = None,
) -> LoRAMetadata:
    """Metadata for contiguous token segments (prefill, chunked prefill), one slot each."""
    if len(segment_lens) != len(segment_slots):
        raise ValueError("one slot per segment")
    token_slots = np.repeat(np.asarray(segment_slots, dtype=np.int64), np.asarray(segment_lens, dtype=np.int64))
    return build_lora_metadata(token_slots, max_loras=max_loras, device=device, block_m=block_m)
