"""The model runner's own CPU cost per decode step: everything but the model's arithmetic.

A real `ModelRunner` on the tiny Qwen2-VL, with its model swapped for a stub whose forward and
logits cost nothing, driven through decode steps of a batch of N requests (prompt 512 tokens,
one new token each step, a new block every `block_size` steps). What is timed is
`execute_model` whole: applying the scheduler's diff, the step's input tensors, the embedding
gather, sampling metadata, the sampler over the tiny model's 12032 logits per row (a real
Qwen2-VL has 151936) and reading the tokens back. With CUDA graphs replaying the model, this
host-side work is what is left of a decode step's CPU time.

    python -m benchmarks.runner_overhead --batch-sizes 1 8 64 --steps 200

Greedy rows and random rows (temperature 0.8, top-p 0.95, seeded) are timed separately: the
second exercises the sampling metadata. Prints the median microseconds per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from mmserve.models.registry import load_model_config
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint
from mmserve.worker.model_runner import ModelRunner

PROMPT_LEN = 512


class StubModel:
    """The model interface the runner calls, at no arithmetic cost: logits are one fixed row."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        self.hidden_size = hidden_size
        self.logits = torch.randn(1, vocab_size)  # [1, V]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], self.hidden_size)  # [T, hidden]

    def __call__(self, embeds: torch.Tensor, positions, kv_caches, metadata) -> torch.Tensor:
        return embeds

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(hidden.shape[0], -1)  # [n, V]


def make_runner(max_num_seqs: int) -> ModelRunner:
    config = load_model_config(checkpoint("qwen2_vl"), dtype="float32", max_model_len=2048)
    runner = ModelRunner(
        config,
        CacheConfig(num_blocks=8),
        SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=2048),
        torch.device("cpu"),
    )
    runner.model = StubModel(config.hidden_size, config.vocab_size)
    return runner


def time_decode_steps(batch_size: int, steps: int, params: SamplingParams) -> float:
    """Median seconds of one decode step of `batch_size` requests."""
    runner = make_runner(batch_size)
    block_size = runner.block_size
    blocks_per_req = -(-(PROMPT_LEN + steps + 1) // block_size)
    req_ids = [f"r{i}" for i in range(batch_size)]
    first_blocks = -(-PROMPT_LEN // block_size)
    new = [
        NewRequestData(
            req_id,
            list(range(1, PROMPT_LEN + 1)),
            [],
            params,
            list(range(i * blocks_per_req, i * blocks_per_req + first_blocks)),
            PROMPT_LEN - 1,
        )
        for i, req_id in enumerate(req_ids)
    ]
    one_each = dict.fromkeys(req_ids, 1)
    runner.execute_model(SchedulerOutput(new, CachedRequestData(), one_each, batch_size, {}, set(), []))
    seconds = []
    for step in range(steps):
        num_computed = PROMPT_LEN + step
        grows = num_computed % block_size == 0
        cached = CachedRequestData(
            req_ids=list(req_ids),
            new_block_ids=[
                [i * blocks_per_req + num_computed // block_size] if grows else [] for i in range(batch_size)
            ],
            num_computed_tokens=[num_computed] * batch_size,
        )
        output = SchedulerOutput([], cached, dict(one_each), batch_size, {}, set(), [])
        start = time.perf_counter()
        runner.execute_model(output)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kinds = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True),
        "random": SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=10_000, ignore_eos=True),
    }
    print(f"{'batch':>6}{'greedy us/step':>16}{'random us/step':>16}")
    for batch_size in args.batch_sizes:
        times = {kind: time_decode_steps(batch_size, args.steps, p) for kind, p in kinds.items()}
        print(f"{batch_size:>6}{1e6 * times['greedy']:>16.0f}{1e6 * times['random']:>16.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
