"""The random draw of the sampler against the exponential race it replaced, on the CPU.

    .venv/bin/python -m benchmarks.sampler_cpu --vocab 12032 151936 --batch 1 8 64

Both draw one token per row of a [B, V] distribution: the exponential race as argmax(probs / q)
with q ~ Exponential(1) per token (what vLLM runs on GPUs, and what mmserve ran before), the
inverse CDF (`mmserve.layers.sampler.inverse_cdf_draw`) with one uniform number per row over a
float64 cumulative sum. Alternating calls in one process with this process's torch threads;
microseconds per call, median of `--rounds`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from mmserve.layers.sampler import inverse_cdf_draw, row_argmax


def exponential_race(probs: torch.Tensor) -> torch.Tensor:
    """The baseline: V exponential numbers a row, then the argmax of probs / q."""
    q = torch.empty_like(probs).exponential_()
    return row_argmax(probs / q)


def time_us(draw: Callable[[], torch.Tensor], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        draw()
    return 1e6 * (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[12032, 151936])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    print(f"threads={torch.get_num_threads()} load={os.getloadavg()[0]:.2f}")
    print(f"{'vocab':>7} {'batch':>5} {'race us':>10} {'inverse cdf us':>15} {'race / cdf':>11}")
    for vocab in args.vocab:
        for batch in args.batch:
            probs = torch.randn(batch, vocab).mul_(3).softmax(dim=-1)  # [B, V] float32
            race, cdf = [], []
            for _ in range(args.rounds):
                race.append(time_us(lambda probs=probs: exponential_race(probs), args.calls))
                cdf.append(time_us(lambda probs=probs: inverse_cdf_draw(probs, {}), args.calls))
            race_us, cdf_us = statistics.median(race), statistics.median(cdf)
            print(f"{vocab:>7} {batch:>5} {race_us:>10.0f} {cdf_us:>15.0f} {race_us / cdf_us:>11.1f}")


if __name__ == "__main__":
    main()
