"""Vision-tower attention: bidirectional within each packed segment, all segments in one launch.

Segments are the rows [cu_seqlens[s], cu_seqlens[s + 1]) of one image (or one window of a
tower's windowed layers). Each program owns BLOCK_M rows of one segment for one head and
streams that segment's keys and values tile by tile with an online softmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from mmserve.ops.triton.attention_common import locate_block, num_block_programs, softmax_step
from mmserve.ops.triton.launch import Launch, dot_extent
from mmserve.ops.triton.unified_attention import LOG2_E

# 64 x 32 tiles with 8 warps compile without register spills on sm_90 in every dtype (float32's
# IEEE dots included; 4 warps spill there): see compile_for_gpu.py.
BLOCK_M = 64
TILE_N = 32
NUM_WARPS = 8


@triton.jit
def _varlen_attention_kernel(
    out_ptr,  # [N, H, D]
    query_ptr,  # [N, H, D]
    key_ptr,  # [N, H, D]
    value_ptr,  # [N, H, D]
    cu_seqlens_ptr,  # [num_segments + 1] int32
    num_segments,
    scale_log2,
    query_stride_token,
    query_stride_head,
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    out_stride_token,
    out_stride_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    segment, query_block = locate_block(cu_seqlens_ptr, num_segments, tl.program_id(0), BLOCK_M)
    start = tl.load(cu_seqlens_ptr + segment)
    length = tl.load(cu_seqlens_ptr + segment + 1) - start
    if query_block * BLOCK_M >= length:
        return
    head = tl.program_id(1)
    rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M], inside the segment
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    row_mask = (rows < length)[:, None] & dim_valid[None, :]
    query = tl.load(
        query_ptr + (start + rows)[:, None] * query_stride_token + head * query_stride_head + dims[None, :],
        mask=row_mask,
        other=0.0,
    )
    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for first in range(0, length, TILE_N):
        columns = first + tl.arange(0, TILE_N)  # [TILE_N], inside the segment
        column_valid = columns < length
        kv_mask = column_valid[:, None] & dim_valid[None, :]
        tokens = (start + columns)[:, None]
        key_ptrs = key_ptr + tokens * key_stride_token + head * key_stride_head + dims[None, :]
        value_ptrs = value_ptr + tokens * value_stride_token + head * value_stride_head + dims[None, :]
        key = tl.load(key_ptrs, mask=kv_mask, other=0.0)  # [TILE_N, HEAD_DIM_PAD]
        value = tl.load(value_ptrs, mask=kv_mask, other=0.0)
        scores = tl.dot(query, tl.trans(key), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(column_valid[None, :], scores, float("-inf"))  # [BLOCK_M, TILE_N]
        running_max, running_sum, probabilities, factor = softmax_step(scores, running_max, running_sum)
        acc = acc * factor[:, None] + tl.dot(
            probabilities.to(value.dtype), value, input_precision=DOT_PRECISION
        )
    out = acc / running_sum[:, None]  # every row sees its whole segment, so the sum is > 0
    tl.store(
        out_ptr + (start + rows)[:, None] * out_stride_token + head * out_stride_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask,
    )


def plan_varlen_attention(
    out: torch.Tensor,  # [N, H, D]
    query: torch.Tensor,  # [N, H, D]
    key: torch.Tensor,  # [N, H, D]
    value: torch.Tensor,  # [N, H, D]
    cu_seqlens: torch.Tensor,  # [num_segments + 1] int32
    scale: float,
) -> Launch:
    if len({query.dtype, key.dtype, value.dtype}) != 1:
        raise ValueError("query, key and value need one dtype")
    if any(t.stride(-1) != 1 for t in (out, query, key, value)):
        raise ValueError("query, key, value and output need contiguous head dims")
    num_rows, num_heads, head_dim = query.shape
    num_segments = cu_seqlens.shape[0] - 1
    args = dict(
        out_ptr=out,
        query_ptr=query,
        key_ptr=key,
        value_ptr=value,
        cu_seqlens_ptr=cu_seqlens,
        num_segments=num_segments,
        scale_log2=scale * LOG2_E,
        query_stride_token=query.stride(0),
        query_stride_head=query.stride(1),
        key_stride_token=key.stride(0),
        key_stride_head=key.stride(1),
        value_stride_token=value.stride(0),
        value_stride_head=value.stride(1),
        out_stride_token=out.stride(0),
        out_stride_head=out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=dot_extent(head_dim),
        BLOCK_M=BLOCK_M,
        TILE_N=TILE_N,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    grid = (num_block_programs(num_rows, num_segments, BLOCK_M), num_heads)
    return Launch(_varlen_attention_kernel, grid, args, num_warps=NUM_WARPS)


def varlen_attention(
    query: torch.Tensor,  # [N, H, D]
    key: torch.Tensor,  # [N, H, D]
    value: torch.Tensor,  # [N, H, D]
    cu_seqlens: torch.Tensor | Sequence[int],  # segment s is rows [cu_seqlens[s], cu_seqlens[s + 1])
    scale: float,
) -> torch.Tensor:  # [N, H, D]
    """`reference.varlen_attention` in one launch. cu_seqlens is an int32 tensor on the query's
    device or a host list (copied over); rows past cu_seqlens[-1] are left unwritten."""
    if not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int32, device=query.device)
    out = torch.empty_like(query)
    plan_varlen_attention(out, query, key, value, cu_seqlens, scale).run()
    return out
