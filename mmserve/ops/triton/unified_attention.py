"""Unified paged attention: one launch for a mixed step of prompt chunks and decode rows.

Each program owns one block of one request's query rows for one kv head: BLOCK_Q query tokens
times the GROUP query heads that share the kv head (GQA), flattened to BLOCK_M = BLOCK_Q * GROUP
rows (padded), so a kv tile read from the cache serves every head that uses it. Programs walk the
request's block table tile by tile with an online softmax, causal with the cached-context offset.
When the grid would be too small to fill the GPU (a few long decodes), the context is cut into
NUM_SPLITS ranges handled by separate programs, and a second kernel combines their partial
softmaxes. Grid sizes come from tensor shapes and the caller's host ints (max_query_len,
max_seq_len): nothing here waits for the device.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mmserve.ops.triton.attention_common import locate_block, num_block_programs, softmax_step
from mmserve.ops.triton.launch import Launch, dot_extent, next_power_of_two

LOG2_E = math.log2(math.e)
MAX_KV_SPLITS = 16
MIN_TOKENS_PER_SPLIT = 256
NOMINAL_MULTIPROCESSORS = 132  # an H100's, for planning when the tensors are not on a GPU


@triton.jit
def _attend_context(
    query,  # [BLOCK_M, HEAD_DIM_PAD]
    query_position,  # [BLOCK_M]: the context position of each row's token; it sees 0 .. that
    row_valid,  # [BLOCK_M]
    head_cache_ptr,  # the cache's keys at this kv head (values are cache_stride_kv further on)
    table_row_ptr,  # this request's row of the block table
    kv_end,  # no row of this block sees a position ≥ kv_end
    scale_log2,
    cache_stride_kv,
    cache_stride_block,
    cache_stride_slot,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over this program's split of the context tiles [0, cdiv(kv_end, TILE_N))
    → (max, sum, unnormalised output); a split with no tiles returns (-inf, 0, 0)."""
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    first_tile = tl.program_id(2) * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for tile in range(first_tile, last_tile):
        positions = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N]
        position_valid = positions < kv_end
        block_ids = tl.load(table_row_ptr + positions // BLOCK_SIZE, mask=position_valid, other=0)
        slots = block_ids.to(tl.int64) * cache_stride_block + (positions % BLOCK_SIZE) * cache_stride_slot
        kv_offsets = slots[:, None] + dims[None, :]  # [TILE_N, HEAD_DIM_PAD]
        kv_mask = position_valid[:, None] & dim_valid[None, :]
        key = tl.load(head_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        value = tl.load(head_cache_ptr + cache_stride_kv + kv_offsets, mask=kv_mask, other=0.0)
        scores = tl.dot(query, tl.trans(key), input_precision=DOT_PRECISION) * scale_log2
        visible = row_valid[:, None] & (positions[None, :] <= query_position[:, None])
        scores = tl.where(visible, scores, float("-inf"))  # [BLOCK_M, TILE_N]
        running_max, running_sum, probabilities, factor = softmax_step(scores, running_max, running_sum)
        acc = acc * factor[:, None] + tl.dot(
            probabilities.to(value.dtype), value, input_precision=DOT_PRECISION
        )
    return running_max, running_sum, acc


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, H, D]
    partial_out_ptr,  # [T, H, NUM_SPLITS, HEAD_DIM_PAD] float32 (split-KV only)
    partial_max_ptr,  # [T, H, NUM_SPLITS] float32, log2 units (split-KV only)
    partial_sum_ptr,  # [T, H, NUM_SPLITS] float32 (split-KV only)
    query_ptr,  # [T, H, D]
    cache_ptr,  # [2, B, S, KVH, D]
    query_start_loc_ptr,  # [R + 1] int32
    seq_lens_ptr,  # [R] int32
    block_table_ptr,  # [R, max_blocks] int32
    num_requests,
    scale_log2,
    query_stride_token,
    query_stride_head,
    out_stride_token,
    out_stride_head,
    cache_stride_kv: tl.int64,
    cache_stride_block: tl.int64,
    cache_stride_slot,
    cache_stride_head,
    block_table_stride,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    request, query_block = locate_block(query_start_loc_ptr, num_requests, tl.program_id(0), BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + request)
    query_len = tl.load(query_start_loc_ptr + request + 1) - query_start
    if query_block * BLOCK_Q >= query_len:
        return
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + request)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)  # row = query token * GROUP + head within the group
    query_index = query_block * BLOCK_Q + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_valid = (rows // GROUP < BLOCK_Q) & (query_index < query_len)
    tokens = query_start + query_index
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    query = tl.load(
        query_ptr + tokens[:, None] * query_stride_token + heads[:, None] * query_stride_head + dims[None, :],
        mask=row_mask,
        other=0.0,
    )

    running_max, running_sum, acc = _attend_context(
        query,
        context_len + query_index,
        row_valid,
        cache_ptr + kv_head * cache_stride_head,
        block_table_ptr + request.to(tl.int64) * block_table_stride,
        context_len + tl.minimum(query_len, (query_block + 1) * BLOCK_Q),
        scale_log2,
        cache_stride_kv,
        cache_stride_block,
        cache_stride_slot,
        HEAD_DIM,
        HEAD_DIM_PAD,
        BLOCK_SIZE,
        BLOCK_M,
        TILE_N,
        NUM_SPLITS,
        DOT_PRECISION,
    )
    if NUM_SPLITS == 1:
        out = acc / tl.where(row_valid, running_sum, 1.0)[:, None]  # padding rows summed nothing
        out_offsets = tokens[:, None] * out_stride_token + heads[:, None] * out_stride_head + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        # An empty split stores max -inf, sum 0: it weighs nothing in the combination.
        partial = (tokens.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + tl.program_id(2)
        tl.store(partial_max_ptr + partial, running_max, mask=row_valid)
        tl.store(partial_sum_ptr + partial, running_sum, mask=row_valid)
        # The whole padded width (zeros past HEAD_DIM), so the combine kernel reads no garbage.
        partial_offsets = partial[:, None] * HEAD_DIM_PAD + dims[None, :]
        tl.store(partial_out_ptr + partial_offsets, acc, mask=row_valid[:, None])


@triton.jit
def _combine_splits_kernel(
    out_ptr,  # [T, H, D]
    partial_out_ptr,  # [T, H, NUM_SPLITS, HEAD_DIM_PAD] float32
    partial_max_ptr,  # [T, H, NUM_SPLITS] float32
    partial_sum_ptr,  # [T, H, NUM_SPLITS] float32
    query_start_loc_ptr,  # [R + 1] int32
    num_requests,
    out_stride_token,
    out_stride_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Program (token, head): the softmax over the whole context from its splits' partials."""
    token = tl.program_id(0)
    if token >= tl.load(query_start_loc_ptr + num_requests):
        return  # a padding row past the last request
    head = tl.program_id(1)
    partial = (token.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    maxes = tl.load(partial_max_ptr + partial)  # [NUM_SPLITS]
    weights = tl.exp2(maxes - tl.max(maxes, axis=0))
    total = tl.sum(tl.load(partial_sum_ptr + partial) * weights, axis=0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    parts = tl.load(partial_out_ptr + partial[:, None] * HEAD_DIM_PAD + dims[None, :])
    out = tl.sum(parts * weights[:, None], axis=0) / total  # [HEAD_DIM_PAD]
    tl.store(
        out_ptr + token * out_stride_token + head * out_stride_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@dataclass(frozen=True)
class AttentionTiles:
    """Tile shape of one launch: BLOCK_M rows = BLOCK_Q query tokens x GROUP heads (padded)."""

    block_m: int
    block_q: int
    tile_n: int
    num_warps: int


def choose_tiles(group: int, max_query_len: int, dtype: torch.dtype) -> AttentionTiles:
    """Decode-only steps get the smallest row block `tl.dot` allows (16 rows: one token's heads
    plus padding); steps with prompt chunks get 64-row blocks so a kv tile serves more queries.
    float32 (IEEE dots, no tensor cores) keeps 16 x 16 tiles: larger ones spill registers on
    sm_90 once the split-KV epilogue stores its row statistics (see compile_for_gpu.py)."""
    if dtype == torch.float32:
        rows, tile_n = 16, 16
    else:
        rows, tile_n = (16 if max_query_len == 1 else 64), 32
    block_m = max(rows, next_power_of_two(group))
    return AttentionTiles(block_m=block_m, block_q=block_m // group, tile_n=tile_n, num_warps=4)


@functools.cache
def _multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return NOMINAL_MULTIPROCESSORS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_kv_splits(active_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Split the context only when the grid cannot fill the GPU twice over and every split would
    still get MIN_TOKENS_PER_SPLIT tokens; a power of two (the combine kernel's tile extent)."""
    wanted_programs = 2 * _multiprocessor_count(device)
    if active_programs >= wanted_programs:
        return 1
    splits = min(MAX_KV_SPLITS, -(-wanted_programs // active_programs), max_seq_len // MIN_TOKENS_PER_SPLIT)
    return 1 << (max(splits, 1).bit_length() - 1)


def _check_layout(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
    if query.shape[1] % kv_cache.shape[3]:
        raise ValueError(f"{query.shape[1]} query heads do not share {kv_cache.shape[3]} kv heads evenly")
    if kv_cache.dtype != query.dtype:
        raise ValueError(f"query is {query.dtype} but the cache is {kv_cache.dtype}")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("query, cache and output need contiguous head dims")


def _combine_args(out: torch.Tensor, query_start_loc: torch.Tensor, num_splits: int) -> dict[str, object]:
    """The arguments both kernels take: the output, the split partials, the batch layout."""
    num_tokens, num_heads, head_dim = out.shape
    head_dim_pad = dot_extent(head_dim)
    partial_out = partial_max = partial_sum = out  # placeholders: the 1-split kernel never reads them
    if num_splits > 1:
        partial_out = out.new_empty(num_tokens, num_heads, num_splits, head_dim_pad, dtype=torch.float32)
        partial_max = out.new_empty(num_tokens, num_heads, num_splits, dtype=torch.float32)
        partial_sum = torch.empty_like(partial_max)
    return dict(
        out_ptr=out,
        partial_out_ptr=partial_out,
        partial_max_ptr=partial_max,
        partial_sum_ptr=partial_sum,
        query_start_loc_ptr=query_start_loc,
        num_requests=query_start_loc.shape[0] - 1,
        out_stride_token=out.stride(0),
        out_stride_head=out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        NUM_SPLITS=num_splits,
    )


def plan_paged_attention(
    out: torch.Tensor,  # [T, H, D]
    query: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, B, S, KVH, D]
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32
    block_table: torch.Tensor,  # [R, max_blocks] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_kv_splits: int | None = None,
) -> list[Launch]:
    """The launches of `paged_attention` (one, or two with split-KV); see its contract."""
    _check_layout(out, query, kv_cache)
    num_tokens, num_heads = query.shape[:2]
    num_kv_heads, num_requests = kv_cache.shape[3], seq_lens.shape[0]
    tiles = choose_tiles(num_heads // num_kv_heads, max_query_len, query.dtype)
    if num_kv_splits is None:
        query_blocks = max(num_requests, -(-num_tokens // tiles.block_q))
        num_kv_splits = choose_num_kv_splits(query_blocks * num_kv_heads, max_seq_len, query.device)
    if num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1):
        raise ValueError(f"num_kv_splits must be a power of two, got {num_kv_splits}")
    common = _combine_args(out, query_start_loc, num_kv_splits)
    attention_args = dict(
        common,
        query_ptr=query,
        cache_ptr=kv_cache,
        seq_lens_ptr=seq_lens,
        block_table_ptr=block_table,
        scale_log2=scale * LOG2_E,
        query_stride_token=query.stride(0),
        query_stride_head=query.stride(1),
        cache_stride_kv=kv_cache.stride(0),
        cache_stride_block=kv_cache.stride(1),
        cache_stride_slot=kv_cache.stride(2),
        cache_stride_head=kv_cache.stride(3),
        block_table_stride=block_table.stride(0),
        GROUP=num_heads // num_kv_heads,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=tiles.block_m,
        BLOCK_Q=tiles.block_q,
        TILE_N=tiles.tile_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    grid = (num_block_programs(num_tokens, num_requests, tiles.block_q), num_kv_heads, num_kv_splits)
    launches = [Launch(_paged_attention_kernel, grid, attention_args, tiles.num_warps)]
    if num_kv_splits > 1:
        launches.append(Launch(_combine_splits_kernel, (num_tokens, num_heads), common, num_warps=1))
    return launches


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, B, S, KVH, D], this step's keys/values already written
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32: context length after this step
    block_table: torch.Tensor,  # [R, max_blocks] int32
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, H, D]
    """`reference.paged_attention` in one launch (two with split-KV), without a device sync.

    max_query_len / max_seq_len are the host-side maxima the caller already has (they pick the
    tile shape and the split count, never a loop bound). num_kv_splits (a power of two) forces
    the split count; None chooses it from the grid size. Query and cache share one dtype
    (float16, bfloat16 or float32); float32 dots run in full IEEE precision, not TF32. Rows past
    query_start_loc[R] are left unwritten, as the reference leaves them.
    """
    out = torch.empty_like(query) if out is None else out
    for launch in plan_paged_attention(
        out,
        query,
        kv_cache,
        query_start_loc,
        seq_lens,
        block_table,
        scale,
        max_query_len,
        max_seq_len,
        num_kv_splits,
    ):
        launch.run()
    return out
