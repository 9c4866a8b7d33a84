"""Vision-tower (varlen) attention on the CPU in bfloat16: torch's flash kernel (SDPA) on the
bfloat16 rows, SDPA on rows widened to float32 (conversions included) and csrc's kernel
(`cpu.varlen_attention`: on AMX tiles, on vdpbf16ps or the tile engine, by build), same process,
interleaved.

    .venv/bin/python -m benchmarks.vision_attention_cpu [--rounds 5]

Shapes: the tiny test model's image (1,024 patches, 4 heads × 16), the mid model's (4,096 × 10 ×
64), Qwen2-VL-2B/7B's tower (4,096 × 16 × 80), two 512-patch images, Qwen2.5-VL-style windows
(64 × 64 patches) and four 256-patch images. Prints the median ms of each candidate, its GFLOP/s
(4·L²·D per head and segment) and bfloat16 SDPA's time ÷ widened SDPA's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from mmserve.ops import cpu
from mmserve.ops.sdpa import varlen_attention_sdpa

SHAPES = {  # name: (segment length, segments, heads, head_dim)
    "tiny image": (1024, 1, 4, 16),
    "mid image": (4096, 1, 10, 64),
    "Qwen2-VL image": (4096, 1, 16, 80),
    "2 x 512": (512, 2, 10, 64),
    "64 windows": (64, 64, 10, 64),
    "4 x 256": (256, 4, 16, 80),
}


def time_candidates(candidates: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each candidate, run round by round in turn after one warm-up each."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for fn in candidates.values():
        fn()
    for _ in range(rounds):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print(f"threads {torch.get_num_threads()}, rounds {args.rounds} (median)")
    for name, (length, segments, heads, head_dim) in SHAPES.items():
        q, k, v = (torch.randn(length * segments, heads, head_dim).bfloat16() for _ in range(3))
        bounds = [i * length for i in range(segments + 1)]
        scale = head_dim**-0.5
        medians = time_candidates(
            {
                "sdpa bf16": partial(varlen_attention_sdpa, q, k, v, bounds, scale),
                "sdpa widened": partial(widened_sdpa, q, k, v, bounds, scale),
                "csrc": partial(cpu.varlen_attention, q, k, v, bounds, scale),
            },
            args.rounds,
        )
        flops = 4 * heads * segments * length * length * head_dim
        cells = "  ".join(f"{n} {1e3 * t:7.1f} ms {flops / t / 1e9:4.0f} GF/s" for n, t in medians.items())
        print(f"{name:15} {cells}  bf16/widened {medians['sdpa bf16'] / medians['sdpa widened']:.2f}")


def widened_sdpa(q, k, v, bounds: list[int], scale: float) -> torch.Tensor:
    return varlen_attention_sdpa(q.float(), k.float(), v.float(), bounds, scale).bfloat16()


if __name__ == "__main__":
    main()
