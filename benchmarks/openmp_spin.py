"""How long libgomp's idle threads spin after a parallel region, for several GOMP_SPINCOUNTs.

    .venv/bin/python -m benchmarks.openmp_spin --spin-counts default 2000 10000 40000 300000

Each count runs in a fresh process (libgomp reads the variable once, when it loads): a torch op
large enough to use every thread, then the main thread sleeps for `--gap-ms`; the process CPU
time spent during that sleep is what the other threads burned spinning before they slept
(mmserve.openmp_env). Reported as the median over `--rounds` regions, per idle thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_CHILD = "--child"


def measure(gap_ms: float, rounds: int) -> dict[str, float]:
    """In this process: CPU ms per idle thread during a `gap_ms` sleep after a parallel region."""
    import torch

    threads = torch.get_num_threads()
    x = torch.ones(1 << 22)
    burned = []
    for _ in range(rounds):
        x.mul_(1.0)  # a region on every thread
        cpu, wall = time.process_time(), time.perf_counter()
        time.sleep(gap_ms / 1e3)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        burned.append(cpu * 1e3 / max(1, threads - 1))
    return {"threads": threads, "spin_ms_per_idle_thread": statistics.median(burned), "gap_ms": gap_ms}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spin-counts", nargs="+", default=["default", "2000", "10000", "40000", "300000"])
    p.add_argument("--gap-ms", type=float, default=50.0, help="Sleep after each region (ms).")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument(_CHILD, action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.gap_ms, args.rounds)))
        return 0
    print("| GOMP_SPINCOUNT | threads | CPU ms an idle thread spins after a region |")
    print("|---|---:|---:|")
    for count in args.spin_counts:
        env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
        if count != "default":
            env["GOMP_SPINCOUNT"] = count
        argv_child = [sys.executable, "-m", "benchmarks.openmp_spin", _CHILD, "--gap-ms", str(args.gap_ms)]
        argv_child += ["--rounds", str(args.rounds)]
        out = subprocess.run(argv_child, env=env, check=True, capture_output=True, text=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        print(f"| {count} | {result['threads']} | {result['spin_ms_per_idle_thread']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
