"""Storing a step's keys and values into the paged KV cache at their slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.ops.triton.launch import Launch, next_power_of_two


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, KVH, D]
    value_ptr,  # [T, KVH, D]
    cache_ptr,  # [2, B, S, KVH, D]
    slot_mapping_ptr,  # [T] int64
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    cache_stride_kv: tl.int64,
    cache_stride_block: tl.int64,
    cache_stride_slot,
    cache_stride_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Program t copies token t's key and value (all kv heads) to its slot, if it has one."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        heads = tl.arange(0, HEADS_PAD)[:, None]
        dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
        mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
        cache_offsets = (
            (slot // BLOCK_SIZE) * cache_stride_block
            + (slot % BLOCK_SIZE) * cache_stride_slot
            + heads * cache_stride_head
            + dims
        )
        key = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head + dims, mask=mask)
        value = tl.load(value_ptr + token * value_stride_token + heads * value_stride_head + dims, mask=mask)
        element = cache_ptr.dtype.element_ty
        tl.store(cache_ptr + cache_offsets, key.to(element), mask=mask)
        tl.store(cache_ptr + cache_stride_kv + cache_offsets, value.to(element), mask=mask)


def plan_write_kv(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    kv_cache: torch.Tensor,  # [2, B, S, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> Launch:
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("keys, values and the cache need contiguous head dims")
    num_tokens, num_kv_heads, head_dim = key.shape
    args = dict(
        key_ptr=key,
        value_ptr=value,
        cache_ptr=kv_cache,
        slot_mapping_ptr=slot_mapping,
        key_stride_token=key.stride(0),
        key_stride_head=key.stride(1),
        value_stride_token=value.stride(0),
        value_stride_head=value.stride(1),
        cache_stride_kv=kv_cache.stride(0),
        cache_stride_block=kv_cache.stride(1),
        cache_stride_slot=kv_cache.stride(2),
        cache_stride_head=kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=next_power_of_two(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_two(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
    )
    return Launch(_write_kv_kernel, (num_tokens,), args, num_warps=1)


def write_kv(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    kv_cache: torch.Tensor,  # [2, B, S, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int64: block_id * S + offset
) -> None:
    """`reference.write_kv`: each token's key and value to its slot, in place, cast to the cache's
    dtype; a negative slot is skipped. key/value may be strided views (of a fused qkv)."""
    plan_write_kv(key, value, kv_cache, slot_mapping).run()
