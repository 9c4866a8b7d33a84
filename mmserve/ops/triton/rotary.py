"""M-RoPE (rotate-half layout, one of three position rows per frequency) applied in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.ops.triton.launch import Launch, next_power_of_two


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x (float32) rounded to `dtype` and back: where the reference's torch ops round."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rotate_heads(
    base_ptr,
    head_stride,
    num_heads,
    cos,  # [HALF_PAD] float32
    sin,  # [HALF_PAD] float32
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Rotate one token's heads in place: [x1, x2] → [x1·cos − x2·sin, x2·cos + x1·sin], each
    product and sum rounded to the tensor's dtype, with cos/sin cast to it first (as the
    reference and transformers compute it)."""
    element = base_ptr.dtype.element_ty
    channels = tl.arange(0, HALF_PAD)
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads < num_heads)[:, None] & (channels < HALF)[None, :]
    first_ptrs = base_ptr + heads[:, None] * head_stride + channels[None, :]  # [HEADS_PAD, HALF_PAD]
    first = tl.load(first_ptrs, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(first_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    cos = _round(cos, element)[None, :]
    sin = _round(sin, element)[None, :]
    rotated_first = _round(first * cos, element) - _round(second * sin, element)
    rotated_second = _round(second * cos, element) + _round(first * sin, element)
    tl.store(first_ptrs, rotated_first.to(element), mask=mask)
    tl.store(first_ptrs + HALF, rotated_second.to(element), mask=mask)


@triton.jit
def _mrope_kernel(
    query_ptr,  # [T, H, D]
    key_ptr,  # [T, KVH, D]
    positions_ptr,  # [3, T] int64
    cos_ptr,  # [max_positions, D / 2] float32
    sin_ptr,  # [max_positions, D / 2] float32
    row_of_channel_ptr,  # [D / 2] int64
    query_stride_token,
    query_stride_head,
    key_stride_token,
    key_stride_head,
    positions_stride_row,
    positions_stride_token,
    cos_stride,
    sin_stride,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Program t rotates every query and key head of token t; each element is read and written
    by this program only, so rotating in place is safe."""
    token = tl.program_id(0)
    channels = tl.arange(0, HALF_PAD)
    channel_valid = channels < HALF
    rows = tl.load(row_of_channel_ptr + channels, mask=channel_valid, other=0)
    position_ptrs = positions_ptr + rows * positions_stride_row + token * positions_stride_token
    position = tl.load(position_ptrs, mask=channel_valid, other=0)  # [HALF_PAD]
    cos = tl.load(cos_ptr + position * cos_stride + channels, mask=channel_valid, other=0.0)
    sin = tl.load(sin_ptr + position * sin_stride + channels, mask=channel_valid, other=0.0)
    query_row = query_ptr + token * query_stride_token
    _rotate_heads(query_row, query_stride_head, NUM_HEADS, cos, sin, HEADS_PAD, HALF, HALF_PAD)
    key_row = key_ptr + token * key_stride_token
    _rotate_heads(key_row, key_stride_head, NUM_KV_HEADS, cos, sin, KV_HEADS_PAD, HALF, HALF_PAD)


def plan_mrope(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KVH, D]
    positions: torch.Tensor,  # [3, T] int64
    cos_cache: torch.Tensor,  # [max_positions, D / 2] float32
    sin_cache: torch.Tensor,  # [max_positions, D / 2] float32
    row_of_channel: torch.Tensor,  # [D / 2] int64
) -> Launch:
    if any(t.stride(-1) != 1 for t in (query, key, cos_cache, sin_cache, row_of_channel)):
        raise ValueError("query, key, the cos/sin caches and row_of_channel need a contiguous last dim")
    num_tokens, num_heads, head_dim = query.shape
    args = dict(
        query_ptr=query,
        key_ptr=key,
        positions_ptr=positions,
        cos_ptr=cos_cache,
        sin_ptr=sin_cache,
        row_of_channel_ptr=row_of_channel,
        query_stride_token=query.stride(0),
        query_stride_head=query.stride(1),
        key_stride_token=key.stride(0),
        key_stride_head=key.stride(1),
        positions_stride_row=positions.stride(0),
        positions_stride_token=positions.stride(1),
        cos_stride=cos_cache.stride(0),
        sin_stride=sin_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=key.shape[1],
        HEADS_PAD=next_power_of_two(num_heads),
        KV_HEADS_PAD=next_power_of_two(key.shape[1]),
        HALF=head_dim // 2,
        HALF_PAD=next_power_of_two(head_dim // 2),
    )
    return Launch(_mrope_kernel, (num_tokens,), args, num_warps=4)


def mrope(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KVH, D]
    positions: torch.Tensor,  # [3, T] int64 (temporal, height, width ids)
    cos_cache: torch.Tensor,  # [max_positions, D / 2] float32
    sin_cache: torch.Tensor,  # [max_positions, D / 2] float32
    row_of_channel: torch.Tensor,  # [D / 2] int64: which position row drives each frequency
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.mrope` applied in place (query and key may be strided views of a fused qkv);
    returns the same two tensors, rotated."""
    plan_mrope(query, key, positions, cos_cache, sin_cache, row_of_channel).run()
    return query, key
