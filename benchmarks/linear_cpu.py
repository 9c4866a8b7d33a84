"""One linear layer on the CPU, every method at every M: what `mmserve.ops.linear` chooses from.

Run from the repository root:

    .venv/bin/python -m benchmarks.linear_cpu [--shape 768 3072] [--rows 1 8 32 512] [--json PATH]

For weight [N, K] (default K=768, N=3072: a mid-size MLP projection) and each row count M, the
candidates run interleaved round by round in one process (a neighbour's burst hits all alike);
the median ms, GFLOP/s and GB/s of weight read are printed. float32: MKL's `F.linear`, oneDNN's
prepacked matmul and csrc's float32 panels; bfloat16: `F.linear`, csrc's bfloat16 panels,
oneDNN's prepacked matmul where the CPU has bfloat16 instructions, and the weight converted to
float32 per call then `F.linear` (what large M could do instead); where N is a gate/up shape (a
multiple of 32), also the bfloat16 panels followed by silu_and_mul against the gated panels that
apply it inside the linear (`cpu.gated_packed_linear`). Each candidate cycles through
copies of its weight, `--weight-mib` in all, so that at small M a call reads its weight from
memory, as a decode step does, not from the last call's cache.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mmserve.ops import cpu, linear

DEFAULT_ROWS = [1, 2, 4, 8, 12, 16, 32, 64, 128, 256, 512, 1024, 2048]


def cycling(
    methods: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """A call of the next method (each over its own copy of the weight) on x."""
    turn = itertools.cycle(methods)
    return lambda: next(turn)(x)


def candidates(
    weight32: torch.Tensor, x32: torch.Tensor, copies: int
) -> dict[str, Callable[[], torch.Tensor]]:
    weight16, x16 = weight32.bfloat16(), x32.bfloat16()
    weights32 = [weight32.clone() for _ in range(copies)]
    weights16 = [weight16.clone() for _ in range(copies)]
    found = {"fp32 F.linear": cycling([functools.partial(F.linear, weight=w) for w in weights32], x32)}
    if linear.onednn_supports(torch.float32):
        found["fp32 oneDNN packed"] = cycling([linear.OneDnnLinear(w) for w in weights32], x32)
    found["fp32 panel kernel"] = cycling([linear.PanelLinear(w) for w in weights32], x32)
    found["bf16 F.linear"] = cycling([functools.partial(F.linear, weight=w) for w in weights16], x16)
    found["bf16 panel kernel"] = cycling([linear.PanelLinear(w) for w in weights16], x16)
    if linear.onednn_supports(torch.bfloat16):  # AVX512-BF16 / AMX
        found["bf16 oneDNN packed"] = cycling([linear.OneDnnLinear(w) for w in weights16], x16)

    def via_float32() -> torch.Tensor:
        return F.linear(x16.float(), weight16.float()).bfloat16()

    found["bf16 via fp32 weight"] = via_float32
    if cpu.is_available() and weight32.shape[0] % 32 == 0:  # a gate/up shape: [2 d, K], d % 16 == 0
        n = weight32.shape[0]
        packs = [cpu.pack_weight(w) for w in weights16]

        def then_silu(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
            return cpu.silu_and_mul(cpu.packed_linear(x, packed, None, n))

        def gated(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
            return cpu.gated_packed_linear(x, packed, None, n)

        for name, fn in (("bf16 gate/up panels then silu_and_mul", then_silu), ("bf16 gate/up gated", gated)):
            found[name] = cycling([functools.partial(fn, packed=p) for p in packs], x16)
    return found


def time_ms(fn: Callable[[], torch.Tensor], budget_s: float) -> float:
    fn()
    start, calls = time.perf_counter(), 0
    while calls < 3 or time.perf_counter() - start < budget_s:
        fn()
        calls += 1
    return 1e3 * (time.perf_counter() - start) / calls


def measure(
    in_features: int, out_features: int, rows: int, rounds: int, weight_bytes: int, only: list[str]
) -> dict[str, float]:
    torch.manual_seed(rows)
    weight, x = torch.randn(out_features, in_features), torch.randn(rows, in_features)
    copies = max(1, -(-weight_bytes // (4 * weight.numel())))
    fns = candidates(weight, x, copies)
    if rows > 256:  # bf16 F.linear runs at ~10 GFLOP/s here: seconds per call at large M
        fns.pop("bf16 F.linear")
    if only:
        fns = {name: fn for name, fn in fns.items() if any(word in name for word in only)}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(time_ms(fn, budget_s=0.05))
    return {name: statistics.median(ms) for name, ms in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=2, default=[768, 3072], metavar=("K", "N"))
    parser.add_argument("--rows", type=int, nargs="+", default=DEFAULT_ROWS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--weight-mib", type=int, default=64, help="float32 bytes of weight copies cycled")
    parser.add_argument("--only", nargs="*", default=[], help="candidates whose name has one of these words")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    in_features, out_features = args.shape
    print(f"K={in_features} N={out_features} threads={torch.get_num_threads()} load={os.getloadavg()[0]:.2f}")
    results = []
    for rows in args.rows:
        medians = measure(in_features, out_features, rows, args.rounds, args.weight_mib << 20, args.only)
        flops = 2 * rows * in_features * out_features
        cells = [
            f"{name} {ms:.3f} ms ({flops / ms / 1e6:.0f} GF/s, "
            f"{in_features * out_features * (2 if 'bf16' in name else 4) / ms / 1e6:.1f} GB/s)"
            for name, ms in medians.items()
        ]
        print(f"M={rows:>5}: " + "; ".join(cells), flush=True)
        results.append({"rows": rows, "ms": medians})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"K": in_features, "N": out_features, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
