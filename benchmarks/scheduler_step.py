"""Scheduler + KV-cache-manager time per step with many running requests (no model).

A fake executor returns one token per decoding request, so the time measured is the
scheduler's own: schedule() + update_from_output(), with prefix caching on and off, side by side.

    .venv/bin/python -m benchmarks.scheduler_step --running 256 --steps 400
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.core.request import Request
from mmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from mmserve.core.scheduler import Scheduler
from mmserve.sampling_params import SamplingParams


def fake_execute(so: SchedulerOutput, scheduler: Scheduler) -> ModelRunnerOutput:
    req_ids, tokens = [], []
    for req_id in so.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        req_ids.append(req_id)
        tokens.append([7] if request.num_computed_tokens >= request.num_tokens else [])
    return ModelRunnerOutput(req_ids, tokens)


def run(num_running: int, steps: int, prompt_len: int, prefix_caching: bool, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    block_size = 16
    blocks_per_req = (prompt_len + steps + 8) // block_size + 2
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=num_running, max_num_batched_tokens=8192, max_model_len=prompt_len + steps + 64
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        num_blocks=num_running * blocks_per_req,
        encoder_budget=8192,
        encoder_cache_size=8192,
    )
    params = SamplingParams(temperature=0.0, max_tokens=steps + 100, ignore_eos=True)
    for i in range(num_running):
        tokens = rng.integers(0, 10000, prompt_len).tolist()  # unique prompts: 0% prefix hits
        scheduler.add_request(Request(f"r{i}", tokens, [], params, block_size))
    # Prefill everything first (not timed), then time decode steps with all requests running.
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.requests.values()):
        so = scheduler.schedule()
        scheduler.update_from_output(so, fake_execute(so, scheduler))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        so = scheduler.schedule()
        scheduler.update_from_output(so, fake_execute(so, scheduler))
        times.append(time.perf_counter() - t0)
        assert len(so.num_scheduled_tokens) == num_running
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    results: dict[str, list[float]] = {"on": [], "off": []}
    for round_ in range(args.rounds):
        for mode in ("on", "off"):
            times = run(args.running, args.steps, args.prompt_len, mode == "on", seed=round_)
            results[mode].append(statistics.median(times))
    on, off = statistics.median(results["on"]), statistics.median(results["off"])
    print(f"running requests: {args.running}, decode steps timed: {args.steps} x {args.rounds} rounds")
    print(f"{'prefix caching':<16}{'median step (ms)':>18}{'per request (us)':>18}")
    for name, value in (("on", on), ("off", off)):
        print(f"{name:<16}{value * 1e3:>18.3f}{value / args.running * 1e6:>18.2f}")
    print(f"on / off: {on / off:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "median_step_s": {"on": on, "off": off}}, f, indent=2)


if __name__ == "__main__":
    main()
