"""torch.compile of the language model against eager, side by side in one process, on the CPU.

    python -m benchmarks.compile_cpu --preset mid --batch 1 8 --context 256 --rounds 3

Two engines on the same folder, one with `compilation_config={"level": 1}`; for each batch size
the rounds alternate between them (so load drifts hit both), each round timing `--steps` whole
engine steps (`EngineCore.step`) of `--batch` requests decoding. Prints the median step of
each and their ratio, and whether both engines produced the same greedy tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.decode_bandwidth import decode_steps
from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint


def same_tokens(eager: LLM, compiled: LLM) -> bool:
    prompts = [{"prompt_token_ids": list(range(100 + 13 * i, 160 + 29 * i))} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for llm in (eager, compiled)]
    return outputs[0] == outputs[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="mid")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    options = dict(
        dtype=args.dtype,
        max_num_seqs=max(args.batch),
        max_num_batched_tokens=max(2048, args.context),
        num_kv_blocks=2 * max(args.batch) * (args.context + args.steps + 64) // 16 + 16,
    )
    model = checkpoint("qwen2_vl", args.preset)
    eager = LLM(model, **options)
    compiled = LLM(model, compilation_config={"level": 1}, **options)
    start = time.perf_counter()
    exact = same_tokens(eager, compiled)  # also the compiled engine's first (compiling) steps
    print(
        f"qwen2_vl-{args.preset} {eager.config.model.dtype} threads={torch.get_num_threads()} "
        f"load={os.getloadavg()[0]:.2f}; same greedy tokens: {exact} (first run, compile "
        f"included: {time.perf_counter() - start:.1f} s)"
    )
    print(f"{'batch':>5} {'eager ms':>9} {'compiled ms':>12} {'eager/compiled':>15}")
    for batch in args.batch:
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.rounds):
            for name, llm in (("eager", eager), ("compiled", compiled)):
                times[name] += decode_steps(llm, batch, args.context, args.steps)
        eager_s, compiled_s = statistics.median(times["eager"]), statistics.median(times["compiled"])
        print(f"{batch:>5} {1e3 * eager_s:>9.2f} {1e3 * compiled_s:>12.2f} {eager_s / compiled_s:>15.2f}")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
