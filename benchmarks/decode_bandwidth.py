"""A decode step against the memory-bandwidth floor: how close the engine gets to the machine.

    .venv/bin/python -m benchmarks.decode_bandwidth --preset mid --batch 1 8 --context 512

A decode step must read every weight of the language model once (and the LM head) plus every
cached key and value of the batch; nothing can make it faster than those bytes ÷ the memory
bandwidth. This measures, in one process: a STREAM-style bandwidth (a large tensor copy:
bytes read + written per second, and a read-only sum), then whole engine steps
(`EngineCore.step`: scheduler, input preparation, forward, sampling) of `--batch` requests all
decoding with `--context` tokens of text context, and reports floor ÷ step time.

The read bandwidth of a shared VM is not one number: on the Zen 4 host of BENCHMARKS.md it sits
at ~35 GB/s for seconds, then at ~60, then back. So a read sample is taken before every
`SAMPLE_EVERY` steps, each such window of steps is held to the floor of its own sample, and the
ratio reported is the median of the windows' ratios (a median of all steps against a median of
all samples would compare a step of one state with a floor of the other).

The bytes are not the only floor: a step also does 2 FLOPs per weight and batch row (and the
attention's 4 per head dimension, head and cached key), which at batch 8 on two cores take about
as long as the reads. So the arithmetic floor is printed beside it: those FLOPs ÷ the rate of a
large matmul in the model's dtype, measured in the same process (the fastest dense work the
machine does). Neither floor is reachable alone; a step near both must overlap the two fully.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from benchmarks.compute_floor import timed_rate
from mmserve.entrypoints.llm import LLM
from mmserve.layers.packed_weights import weight_bytes as packed_weight_bytes
from mmserve.model_config import ModelConfig
from mmserve.ops.huge_pages import empty_on_huge_pages
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint

SAMPLE_EVERY = 5  # steps per window, each after one read sample


def stream_bandwidth(num_bytes: int = 1 << 30, rounds: int = 7) -> dict[str, float]:
    """Bytes per second of a copy (read + write counted) and of a read-only reduction, on buffers
    far larger than any cache, with this process's torch threads."""
    src = empty_on_huge_pages((num_bytes // 4,), torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    copy, read = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        dst.copy_(src)
        copy.append(2 * num_bytes / (time.perf_counter() - start))
        start = time.perf_counter()
        src.sum()
        read.append(num_bytes / (time.perf_counter() - start))
    return {"copy_bytes_per_s": statistics.median(copy), "read_bytes_per_s": statistics.median(read)}


class ReadBandwidth:
    """Read-only bandwidth samples taken on demand (`sample()`: the faster of two sums over a
    buffer ~8× a server CPU's last-level cache, best of trials as STREAM reports; one sum alone
    read 3-16 GB/s now and then among 35s), so that they can be interleaved with the work
    measured."""

    def __init__(self, num_bytes: int = 1 << 28) -> None:
        # on huge pages as the engine's weights and KV cache are, so the floor is not understated
        self.buffer = empty_on_huge_pages((num_bytes // 4,), torch.float32).fill_(1.0)
        self.samples: list[float] = []

    def sample(self, trials: int = 2) -> None:
        seconds = []
        for _ in range(trials):
            start = time.perf_counter()
            self.buffer.sum()
            seconds.append(time.perf_counter() - start)
        self.samples.append(self.buffer.numel() * 4 / min(seconds))


def matmul_rate(dtype: torch.dtype, size: int = 2048) -> float:
    """FLOP/s of a large square matmul in `dtype`: the machine's dense peak as torch reaches it,
    with this process's threads."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    return timed_rate(2 * size**3, lambda: a @ b)


def step_flops(config: ModelConfig, batch: int, context: int) -> float:
    """FLOPs of one decode step of `batch` rows at `context` cached keys: every linear of the
    language model and the LM head (2 per weight and row), and attention's scores and values
    (4 per head dimension, query head and key)."""
    hidden = config.hidden_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * config.intermediate_size
    weights = config.num_layers * per_layer + config.vocab_size * hidden
    attention = 4 * config.num_layers * q * context
    return batch * (2 * weights + attention)


def weight_bytes(llm: LLM) -> int:
    """Bytes a decode step reads of the weights: the language model's, but its embedding table
    (only the batch's rows are gathered), plus the LM head (the same tensor when tied, then read
    whole by the head's matmul). The vision tower is idle. Packed weights (mmserve.ops.linear)
    count as held."""
    model = llm.engine_core.executor.runner.model

    def size(tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

    head = model.lm_head  # packed: the head reads its own copy, tied or not
    head_bytes = size(head.weight) if head.linear_method is None else head.linear_method.weight_bytes
    return packed_weight_bytes(model.model) - size(model.model.embed_tokens.weight) + head_bytes


def decode_steps(
    llm: LLM, batch: int, context: int, steps: int, between: Callable[[], None] | None = None, every: int = 5
) -> list[float]:
    """Seconds of each of `steps` engine steps once `batch` requests are all decoding;
    `between` (untimed) runs before the first timed step and after every `every` steps."""
    rng = np.random.default_rng(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    prompts = [{"prompt_token_ids": rng.integers(100, 11000, context).tolist()} for _ in range(batch)]
    for prompt in prompts:
        llm._submit(llm._inputs.prompt(prompt), params)
    core = llm.engine_core
    while core.scheduler.waiting or any(
        r.num_computed_tokens < r.num_tokens - 1 for r in core.scheduler.running
    ):
        core.step()  # prefill
    for _ in range(3):
        core.step()  # warm-up decode steps
    times = []
    for index in range(steps):
        if between is not None and index % every == 0:
            between()
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    while core.has_work():
        core.step()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen2_vl")
    parser.add_argument("--preset", default="mid")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    llm = LLM(
        checkpoint(args.family, args.preset),
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        max_num_seqs=max(args.batch),
        max_num_batched_tokens=max(2048, args.context),
        num_kv_blocks=max(args.batch) * (args.context + args.steps + 64) // 16 + 16,
    )
    config = llm.config.model
    bandwidth = stream_bandwidth()  # reported; the floors use the interleaved readings below
    dtype = getattr(torch, config.dtype)
    peak = matmul_rate(dtype)
    kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize
    weights = weight_bytes(llm)
    rows = []
    for batch in args.batch:
        reader = ReadBandwidth()
        times = decode_steps(llm, batch, args.context, args.steps, between=reader.sample, every=SAMPLE_EVERY)
        step = statistics.median(times)
        read = statistics.median(reader.samples)
        kv = batch * (args.context + args.steps // 2) * kv_bytes_per_token
        arithmetic_floor = step_flops(config, batch, args.context + args.steps // 2) / peak
        # window i: the steps after read sample i, against that sample's floor
        windows = [
            ((weights + kv) / sample, statistics.median(times[i * SAMPLE_EVERY : (i + 1) * SAMPLE_EVERY]))
            for i, sample in enumerate(reader.samples)
        ]
        window_ratios = [floor / window_step for floor, window_step in windows]
        rows.append(
            {
                "batch": batch,
                "median_step_s": step,
                "read_bytes_per_s": read,
                "read_samples": reader.samples,
                "window_steps_s": [window_step for _, window_step in windows],
                "window_floor_over_step": window_ratios,
                "weights_bytes": weights,
                "kv_bytes": kv,
                "floor_s": (weights + kv) / read,
                "floor_over_step": statistics.median(window_ratios),
                "effective_bytes_per_s": (weights + kv) / step,
                "arithmetic_floor_s": arithmetic_floor,
                "arithmetic_floor_over_step": arithmetic_floor / step,
            }
        )
    result = {
        "model": f"{args.family}-{args.preset}",
        "dtype": str(config.dtype),
        "attention_backend": llm.engine_core.executor.runner.attention_backend.name,
        "threads": torch.get_num_threads(),
        "load_before": os.getloadavg()[0],
        "bandwidth": bandwidth,
        "matmul_flops_per_s": peak,
        "rows": rows,
    }
    print(
        f"{result['model']} {result['dtype']} backend={result['attention_backend']} "
        f"threads={result['threads']} load={result['load_before']:.2f}"
    )
    print(
        f"STREAM copy {bandwidth['copy_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"read {bandwidth['read_bytes_per_s'] / 1e9:.1f} GB/s; matmul {peak / 1e9:.0f} GFLOP/s"
    )
    print(
        f"{'batch':>5} {'step ms':>9} {'read GB/s (range)':>18} {'floor ms':>9} {'floor/step':>11} "
        f"{'(windows)':>11} {'GB/s':>7} {'arith ms':>9} {'arith/step':>11}"
    )
    for row in rows:
        samples = [s / 1e9 for s in row["read_samples"]]
        ratios = row["window_floor_over_step"]
        print(
            f"{row['batch']:>5} {1e3 * row['median_step_s']:>9.2f} "
            f"{f'{min(samples):.0f}-{max(samples):.0f}':>18} "
            f"{1e3 * row['floor_s']:>9.2f} {row['floor_over_step']:>11.2f} "
            f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>11} {row['effective_bytes_per_s'] / 1e9:>7.1f} "
            f"{1e3 * row['arithmetic_floor_s']:>9.2f} {row['arithmetic_floor_over_step']:>11.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    llm.close()


if __name__ == "__main__":
    main()
