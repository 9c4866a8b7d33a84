"""Peak memory of loading a model: does the loader hold more than the model it builds?

    .venv/bin/python -m benchmarks.load_memory --preset mid --dtype float32 bfloat16

For each dtype a fresh process builds the model as a worker does
(`mmserve.worker.kernel_plan.load_planned_model`: the architecture born in its final dtype, the
safetensors read tensor by tensor, then each CPU linear packed and its plain weight dropped)
while a thread samples the process's anonymous resident memory (`RssAnon`: the heap, not the
checkpoint file's page-cache pages that safetensors maps). Reported: the model's bytes as held
afterwards (parameters + packed weights), the peak anonymous memory the load added, and peak ÷
model. A loader that materialised the checkpoint at full size first, or kept plain and packed
copies side by side, would show ≈ 2.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import threading
import time

import torch


def anonymous_bytes() -> int:
    """This process's anonymous resident memory (bytes), from /proc/self/status."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    """Samples `anonymous_bytes()` every `interval_s` on a thread until stopped; keeps the max."""

    def __init__(self, interval_s: float = 0.0005) -> None:
        self.interval_s = interval_s
        self.peak = anonymous_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, anonymous_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anonymous_bytes())


def measure(preset: str, dtype_name: str, queue: multiprocessing.Queue) -> None:
    """In a fresh process: load the preset's checkpoint in `dtype_name`; put the figures on `queue`."""
    from mmserve.config import ExecutionConfig
    from mmserve.layers.packed_weights import weight_bytes
    from mmserve.models.registry import load_model_config
    from mmserve.testing.checkpoints import checkpoint
    from mmserve.worker.kernel_plan import load_planned_model

    path = checkpoint("qwen2_vl", preset)
    config = load_model_config(str(path), dtype_name, None)
    before = anonymous_bytes()
    with PeakSampler() as sampler:
        model, _, _ = load_planned_model(config, torch.device("cpu"), ExecutionConfig(), 16)
    held = weight_bytes(model)
    queue.put(
        {
            "preset": preset,
            "dtype": dtype_name,
            "model_bytes": held,
            "peak_added_bytes": sampler.peak - before,
            "after_added_bytes": anonymous_bytes() - before,
        }
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="mid")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--json")
    args = p.parse_args(argv)
    context = multiprocessing.get_context("spawn")
    results = []
    print(f"{'dtype':10s} {'model MB':>9s} {'peak added MB':>14s} {'after MB':>9s} {'peak/model':>11s}")
    for dtype_name in args.dtype:
        queue = context.Queue()
        process = context.Process(target=measure, args=(args.preset, dtype_name, queue))
        process.start()
        result = queue.get()
        process.join()
        results.append(result)
        model, peak, after = (
            result[k] / (1 << 20) for k in ("model_bytes", "peak_added_bytes", "after_added_bytes")
        )
        print(f"{dtype_name:10s} {model:9.1f} {peak:14.1f} {after:9.1f} {peak / model:11.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
