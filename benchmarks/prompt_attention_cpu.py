"""One request's prompt chunk through `mmserve.ops.cpu.paged_attention` against torch's flash
kernel for the CPU called on the chunk's gathered keys: what csrc/prompt_attention.h chooses by.

    .venv/bin/python -m benchmarks.prompt_attention_cpu [--dtype bfloat16 float32] [--rounds 9]

The mid test model's shapes (12 query heads, 4 kv heads, head_dim 64, block size 16): whole
prompts of 32-1024 tokens and chunks after 512-960 cached keys. Both candidates run interleaved
in one process; the median ms of each and their ratio are printed. Since csrc/prompt_attention.h,
paged_attention itself hands chunks of kPromptAttentionMinQueries or more to the flash kernel,
so to see the tile engine at every length run this at a commit before it (b25fecf; copy the
file there), and at HEAD to see the two agree above the threshold.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable

import torch

from mmserve.ops import cpu

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 4, 64, 16
CASES = [(32, 0), (64, 0), (128, 0), (256, 0), (512, 0), (1024, 0)]  # (queries, cached keys)
CASES += [(32, 992), (64, 960), (256, 512), (512, 512)]


def flash_over_gathered(
    query: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, num_keys: int, scale: float
) -> torch.Tensor:
    """csrc/prompt_attention.cpp's computation in torch: gather, broadcast over GQA, one call."""
    queries, group = query.shape[0], HEADS // KV_HEADS
    kv = kv_cache.index_select(1, blocks).flatten(1, 2)[:, :num_keys]  # [2, keys, KVH, D]
    q = query.view(queries, KV_HEADS, group, HEAD_DIM).permute(1, 2, 0, 3)
    k, v = (t.permute(1, 0, 2).unsqueeze(1).expand(KV_HEADS, group, num_keys, HEAD_DIM) for t in kv)
    context = num_keys - queries
    mask = None
    if context > 0:
        hidden = torch.arange(num_keys)[None, :] > torch.arange(context, num_keys)[:, None]
        mask = torch.zeros(queries, num_keys, dtype=query.dtype).masked_fill_(hidden, -math.inf)[None, None]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, _ = flash(q, k, v, 0.0, context == 0, attn_mask=mask, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(queries, HEADS, HEAD_DIM)


def median_ms(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def time_case(dtype: torch.dtype, queries: int, context: int, rounds: int) -> tuple[float, float]:
    """Median ms of paged_attention and of the flash kernel on gathered keys, interleaved."""
    torch.manual_seed(queries + context)
    keys = queries + context
    used = -(-keys // BLOCK_SIZE)
    kv_cache = torch.randn(2, used + 8, BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(dtype)
    blocks = torch.randperm(used + 8)[:used]  # scattered, as a real block table
    query = torch.randn(queries, HEADS, HEAD_DIM).to(dtype)
    starts = torch.tensor([0, queries], dtype=torch.int32)
    lengths = torch.tensor([keys], dtype=torch.int32)
    table = blocks.to(torch.int32)[None]
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(query)

    def paged() -> None:
        cpu.paged_attention(query, kv_cache, starts, lengths, table, scale, out=out)

    def flash() -> None:
        flash_over_gathered(query, kv_cache, blocks, keys, scale)

    paged_ms, flash_ms = [], []
    for _ in range(3):
        paged_ms.append(median_ms(paged, rounds))
        flash_ms.append(median_ms(flash, rounds))
    return statistics.median(paged_ms), statistics.median(flash_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    print(f"threads={torch.get_num_threads()} load={os.getloadavg()[0]:.2f}")
    print("dtype     queries  cached  paged_attention ms  flash ms  paged ÷ flash")
    for name in args.dtype:
        for queries, context in CASES:
            a, b = time_case(getattr(torch, name), queries, context, args.rounds)
            print(f"{name:9} {queries:7} {context:7} {a:18.2f} {b:9.2f} {a / b:14.2f}", flush=True)


if __name__ == "__main__":
    main()
