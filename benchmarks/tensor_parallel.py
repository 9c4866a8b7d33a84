"""TP=1 vs TP=2 on the CPU: engine step time and what each step communicates.

For each tensor-parallel size, the offline engine runs --batch text prompts of --prompt-len
tokens, each generating --output-len tokens (EOS ignored), then one request with an image in
each vision-tower mode. Every engine step is timed around the executor's `execute_model` (so a
TP>1 step includes sending the scheduler output to the worker processes and receiving rank 0's
tokens); the steps after the prefill are the decode steps. Per decode step it reports the bytes
broadcast to the workers and, from rank 0's counters, the collectives' calls and bytes.

    python benchmarks/tensor_parallel.py --preset mid --configs 1x2 1x1 2x1 \
        --json benchmarks/results/tensor_parallel_mid.json
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import time

from mmserve import LLM, SamplingParams
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.reference import png_bytes, synthetic_image


def timed_steps(llm: LLM, run) -> list[tuple[bool, float, int]]:
    """(step sent a new request, seconds, bytes to the workers) for each step of `run()`."""
    executor = llm.engine_core.executor
    execute = executor.execute_model
    steps = []

    def timed(scheduler_output):
        start = time.perf_counter()
        output = execute(scheduler_output)
        seconds = time.perf_counter() - start
        steps.append((bool(scheduler_output.scheduled_new_reqs), seconds, executor.last_step_bytes))
        return output

    executor.execute_model = timed
    try:
        run()
    finally:
        del executor.execute_model
    return steps


def counters(llm: LLM) -> dict[str, dict[str, int]]:
    """Rank 0's cumulative collective calls and bytes, per operation."""
    info = llm.engine_core.executor.collective_rpc("shard_info")[0]
    return {"calls": info["collective_calls"], "bytes": info["collective_bytes"]}


def delta(after: dict, before: dict) -> dict:
    return {
        key: {op: n - before[key].get(op, 0) for op, n in after[key].items()} for key in ("calls", "bytes")
    }


def decode_run(llm: LLM, batch: int, prompt_len: int, output_len: int) -> dict:
    """Step times of a batch, and the collectives of one decode step: those of a run generating
    `output_len` tokens less those of the same prefill generating one, over output_len - 1."""

    def prompts(first: int) -> list[dict]:  # distinct per call: no prefix-cache hit
        return [
            {"prompt_token_ids": [(7 * (first + i) + j) % 5000 + 100 for j in range(prompt_len)]}
            for i in range(batch)
        ]

    llm.generate(prompts(1000)[:1], SamplingParams(temperature=0, max_tokens=4))  # warm up
    start = counters(llm)
    llm.generate(prompts(0), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    prefill_only = delta(counters(llm), start)
    middle = counters(llm)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    steps = timed_steps(llm, lambda: llm.generate(prompts(batch), params))
    full = delta(counters(llm), middle)
    decode = [(seconds, size) for new, seconds, size in steps if not new]
    per_decode_step = {
        key: {op: (n - prefill_only[key].get(op, 0)) / (output_len - 1) for op, n in full[key].items()}
        for key in ("calls", "bytes")
    }
    return {
        "prefill_step_ms": 1000 * sum(s for new, s, _ in steps if new),
        "decode_steps": len(decode),
        "decode_step_ms_median": 1000 * statistics.median(s for s, _ in decode),
        "broadcast_bytes_per_decode_step": statistics.median(b for _, b in decode),
        "collective_calls_per_decode_step": per_decode_step["calls"],
        "collective_bytes_per_decode_step": per_decode_step["bytes"],
    }


def image_messages(seed: int) -> list[dict]:
    image = "data:image/png;base64," + base64.b64encode(png_bytes(synthetic_image(448, 448, seed))).decode()
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is it?"}]
    return [{"role": "user", "content": content}]


def image_run(llm: LLM) -> float:
    """Milliseconds of the steps that encode one 448x448 image and prefill its prompt (a new
    image each time, so no cache is hit)."""
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.chat(image_messages(3), params)  # warm up
    steps = timed_steps(llm, lambda: llm.chat(image_messages(4), params))
    return 1000 * sum(seconds for _, seconds, _ in steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="mid")
    parser.add_argument("--family", default="qwen2_vl")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["1x2", "1x1", "2x1"],
        help="TPxTHREADS: tensor-parallel size by torch threads per rank",
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model_dir = checkpoint(args.family, args.preset)
    results = {"load": os.getloadavg(), "cores": len(os.sched_getaffinity(0)), "args": vars(args), "runs": {}}
    for spec in args.configs:
        tp, threads = (int(part) for part in spec.split("x"))
        for mode in ("weights", "data") if tp > 1 else ("weights",):
            settings = {"tensor_parallel_size": tp, "mm_encoder_tp_mode": mode, "num_threads": threads}
            with LLM(model_dir, dtype="float32", **settings) as llm:
                run = {"load_before": os.getloadavg()[0], "image_step_ms": image_run(llm)}
                if mode == "weights":
                    run |= decode_run(llm, args.batch, args.prompt_len, args.output_len)
            results["runs"][f"tp{tp}-threads{threads}-{mode}"] = run
            print(f"tp={tp} threads/rank={threads} vision={mode}: {json.dumps(run)}", flush=True)
    results["load_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
