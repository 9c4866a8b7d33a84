"""flash-attn's kernels (the `flash_attn` package, ≥ 2.6), the only importer of it.

Paged attention is `flash_attn_varlen_func` with a block table: the queries of every request
packed back to back (`cu_seqlens_q`), each request's context read from the paged cache through
its block table row (`cu_seqlens_k` gives the context lengths), causal aligned to the end of the
context, which is the contract of `reference.paged_attention`. Its limits, checked by
`unsupported_reason`: a CUDA device, float16 / bfloat16, and (flash-attn 2) a cache block size
that is a multiple of 256. The vision tower's packed windows use the same function without a
block table.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from itertools import pairwise
from types import ModuleType

import torch

PAGED_BLOCK_MULTIPLE = 256  # flash-attn 2 rejects smaller pages ("must be divisible by 256")
DTYPES = (torch.float16, torch.bfloat16)


def is_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


@cache
def _module() -> ModuleType:
    import flash_attn

    return flash_attn


def unsupported_reason(device: torch.device, dtype: torch.dtype, block_size: int) -> str | None:
    """Why flash-attn cannot serve this model here, or None when it can."""
    if not is_installed():
        return "the flash_attn package is not installed (pip install 'mmserve[gpu]' on a CUDA machine)"
    if device.type != "cuda":
        return f"flash-attn runs on CUDA devices only, not {device.type}"
    if dtype not in DTYPES:
        return f"flash-attn computes in float16 or bfloat16, not {dtype} (pass --dtype bfloat16)"
    if block_size % PAGED_BLOCK_MULTIPLE:
        return (
            f"flash-attn's paged kernel needs a KV block size that is a multiple of "
            f"{PAGED_BLOCK_MULTIPLE}, not {block_size} (pass --block-size 256)"
        )
    return None


def cumulative_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """[R] int32 → [R + 1] int32 prefix sums starting at 0, on the device (no sync)."""
    out = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, B, S, KVH, D], this step's keys/values already written
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_start_loc: torch.Tensor,  # [R + 1] int32: prefix sums of the context lengths
    block_table: torch.Tensor,  # [R, max_blocks] int32
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,  # an upper bound is enough (a captured graph passes the model length)
) -> torch.Tensor:  # [T, H, D]
    """`reference.paged_attention` with flash-attn's varlen kernel over the block table."""
    return _module().flash_attn_varlen_func(
        query,
        kv_cache[0],
        kv_cache[1],
        cu_seqlens_q=query_start_loc,
        cu_seqlens_k=seq_start_loc,
        max_seqlen_q=max_query_len,
        max_seqlen_k=max_seq_len,
        softmax_scale=scale,
        causal=True,
        block_table=block_table,
    )


def varlen_attention(
    query: torch.Tensor,  # [N, H, D]
    key: torch.Tensor,  # [N, H, D]
    value: torch.Tensor,  # [N, H, D]
    cu_seqlens: list[int],  # segment s is rows [cu_seqlens[s], cu_seqlens[s + 1])
    scale: float,
) -> torch.Tensor:  # [N, H, D]
    """`reference.varlen_attention` (bidirectional within each segment) in one launch."""
    bounds = torch.tensor(cu_seqlens, dtype=torch.int32).pin_memory().to(query.device, non_blocking=True)
    longest = max((end - start for start, end in pairwise(cu_seqlens)), default=0)
    return _module().flash_attn_varlen_func(
        query,
        key,
        value,
        cu_seqlens_q=bounds,
        cu_seqlens_k=bounds,
        max_seqlen_q=longest,
        max_seqlen_k=longest,
        softmax_scale=scale,
        causal=False,
    )
