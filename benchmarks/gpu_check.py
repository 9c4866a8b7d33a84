"""The one prepared check for a lent GPU: the CUDA paths' correctness first, then their timings,
as one JSON report.

    python -m benchmarks.gpu_check                  # CUDA: the report goes to $OUT/gpu_check.json
    python -m benchmarks.gpu_check --cpu --checks backends engine graphs   # the logic, on a CPU

Correctness (`gpu_check_cases.py`; `passed` true/false per check, with the numbers behind it):
  backends  every attention backend that runs here against the torch reference op over random
            ragged steps (decode rows, prompt chunks, long split-KV contexts, GQA 1/2/6, block
            tables with holes; fp32 and bf16 on CUDA), plus the kernel sets' other ops
  engine    the engine against transformers, greedy, float32, Qwen2-VL and Qwen2.5-VL (tiny),
            an image prompt chunked over several steps and a text prompt, run eagerly
  graphs    decode CUDA graphs on vs off (--enforce-eager), token-identical over batches that
            pad up to the ladder, with the number of replays (proof that graphs ran)
  compile   torch.compile'd language model vs eager, token-identical
  syncs     no host sync inside the model's forward (CUDA's sync debug mode set to "error")
Timings (CUDA only, bf16; `gpu_timings.py`): HBM bandwidth and the bf16 matmul ceiling measured in
the same run; decode steps of the mid model and of the 2B-shaped Qwen2-VL at batch 1 / 8 / 64
against the HBM floor, graphs on and off; a prefill step against the matmul ceiling; offline
VisionArena-style throughput of the mid model.

Runtime on one H200 (stop 39, without flash-attn): 188 s, the first run on a bare machine
(checkpoints generated, Triton JIT): correctness 75 s, timings 113 s. A timing section that
would start after --budget-s (default 420 s) is skipped and says so.
Without CUDA and without --cpu it exits with status 2 and says why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.gpu_check_cases import check_backends, check_compile, check_engine, check_graphs, check_syncs

CHECKS: dict[str, Callable[[torch.device], dict]] = {
    "backends": check_backends,
    "engine": check_engine,
    "graphs": check_graphs,
    "compile": check_compile,
    "syncs": check_syncs,
}


def default_output() -> Path:
    return Path(os.environ.get("OUT", ".")) / "gpu_check.json"


def run_section(name: str, fn: Callable[[], dict]) -> dict:
    """One section's result with its wall time; an exception is recorded, not raised, so one
    failure does not hide the other results."""
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as e:
        result = {"passed": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    result["seconds"] = round(time.perf_counter() - start, 2)
    print(f"[gpu_check] {name}: {_summary(result)} ({result['seconds']} s)", flush=True)
    return result


def _summary(result: dict) -> str:
    if "skipped" in result:
        return f"skipped ({result['skipped']})"
    if "passed" in result:
        return "passed" if result["passed"] else f"FAILED {result.get('error', '')}"
    return "done"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="report path (default $OUT/gpu_check.json)")
    parser.add_argument("--cpu", action="store_true", help="run the correctness checks on the CPU")
    parser.add_argument("--checks", nargs="*", choices=list(CHECKS), default=list(CHECKS))
    parser.add_argument("--no-timings", action="store_true")
    parser.add_argument("--budget-s", type=float, default=420.0, help="no timing section starts after this")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU "
            "machine, or pass --cpu to run the correctness checks on the CPU",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    device = torch.device("cpu" if args.cpu else "cuda")
    report: dict = {"device": _device_name(device), "torch": torch.__version__, "checks": {}}
    for name in args.checks:
        report["checks"][name] = run_section(name, lambda name=name: CHECKS[name](device))
    if device.type == "cuda" and not args.no_timings:
        from benchmarks.gpu_timings import run_timings

        report["timings"] = run_timings(lambda: time.perf_counter() - started < args.budget_s, run_section)
    report["passed"] = all(r.get("passed", True) for r in report["checks"].values())
    report["seconds"] = round(time.perf_counter() - started, 1)
    out = args.out or default_output()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"[gpu_check] {'all checks passed' if report['passed'] else 'CHECKS FAILED'}; report: {out}")
    return 0 if report["passed"] else 1


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    raise SystemExit(main())
