"""Store new tokens' K and V into their paged-cache slots: one launch for both tensors."""

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    head_dim,
    key_token_stride,
    key_head_stride,
    value_token_stride,
    value_head_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        cache_offsets = (
            (slot // block_size) * cache_block_stride
            + (slot % block_size) * cache_slot_stride
            + heads * cache_head_stride
            + dims
        )
        row = token.to(tl.int64)
        key = tl.load(key_ptr + row * key_token_stride + heads * key_head_stride + dims, mask=mask)
        value = tl.load(value_ptr + row * value_token_stride + heads * value_head_stride + dims, mask=mask)
        tl.store(key_cache_ptr + cache_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + cache_offsets, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key[t]``/``value[t]`` ([T, num_kv_heads, head_dim], any token/head strides) at
    slot ``slot_mapping[t]`` of the caches; a slot of -1 (padding) is skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1 or key_cache.stride(3) != 1:
        raise ValueError("write_kv_cache needs head_dim contiguous in inputs and caches")
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key and value caches must share one layout")
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_kv_heads,
        head_dim,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
