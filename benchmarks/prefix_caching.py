"""Throughput through `LLM.generate` with prefix caching on vs off at a 0% hit rate.

Every prompt starts with different random tokens, so no block is ever shared: what prefix
caching costs when it cannot help. Engines with caching on and off are both built up front and
run in alternation over several rounds in one process, so machine noise hits both alike.

    .venv/bin/python -m benchmarks.prefix_caching --preset tiny --num-prompts 64 --rounds 5

On a shared machine the wall-clock ratio moves by several percent from round to round, more
than the cost being measured. `--profile` also runs one more round of each engine under
cProfile and reports the CPU time spent in the KV cache manager, the block pool and block
hashing with caching on and off: the cost of prefix caching itself, which load does not blur.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import statistics
import time

import numpy as np
import torch

from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint


def prompts(num: int, length: int, seed: int, vocab: int = 12000) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(0, vocab, length).tolist()} for _ in range(num)]


CACHE_CODE = ("mmserve/core/kv_cache_manager.py", "mmserve/core/block_pool.py", "mmserve/core/block_hash.py")


def profiled_cache_seconds(engine: LLM, batch: list[dict], params: SamplingParams) -> tuple[float, float]:
    """(CPU seconds of the whole generate call, of it in the cache code's own functions)."""
    profile = cProfile.Profile()
    profile.runcall(engine.generate, batch, params)
    stats = pstats.Stats(profile).stats  # {(file, line, name): (calls, prim, tottime, cumtime, callers)}
    cache = sum(entry[2] for key, entry in stats.items() if key[0].endswith(CACHE_CODE))
    return sum(entry[2] for entry in stats.values()), cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen2_vl")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", default="")
    parser.add_argument("--profile", action="store_true", help="also measure the cache code's CPU time")
    args = parser.parse_args()
    model = checkpoint(args.family, args.preset)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engines = {
        mode: LLM(
            model,
            dtype=args.dtype,
            enable_prefix_caching=(mode == "on"),
            max_num_seqs=256,
            num_kv_blocks=4096,
        )
        for mode in ("on", "off")
    }
    engines["on"].generate(prompts(4, args.prompt_len, seed=999), params)  # warm-up
    engines["off"].generate(prompts(4, args.prompt_len, seed=999), params)
    tokens_per_s: dict[str, list[float]] = {"on": [], "off": []}
    for round_ in range(args.rounds):
        batch = prompts(args.num_prompts, args.prompt_len, seed=round_)
        for mode in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
            t0 = time.perf_counter()
            outs = engines[mode].generate(batch, params)
            elapsed = time.perf_counter() - t0
            total = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
            tokens_per_s[mode].append(total / elapsed)
    hits = engines["on"].stats().prefix_cache_hits
    on, off = statistics.median(tokens_per_s["on"]), statistics.median(tokens_per_s["off"])
    machine = platform.processor() or platform.machine()
    print(
        f"model {args.family}/{args.preset} {args.dtype}, torch threads {torch.get_num_threads()}, {machine}"
    )
    print(
        f"{args.num_prompts} prompts x {args.prompt_len} tokens, {args.output_len} output tokens, "
        f"{args.rounds} rounds"
    )
    print(f"prefix cache hits with caching on: {hits} tokens (0% hit rate by construction)")
    print(f"{'prefix caching':<16}{'median tokens/s':>18}")
    print(f"{'on':<16}{on:>18.1f}\n{'off':<16}{off:>18.1f}")
    print(f"on / off throughput: {on / off:.4f}  (loss {100 * (1 - on / off):.2f}%)")
    result = {"args": vars(args), "tokens_per_s": tokens_per_s, "ratio": on / off}
    if args.profile:
        batch = prompts(args.num_prompts, args.prompt_len, seed=args.rounds)
        seconds = {mode: profiled_cache_seconds(engines[mode], batch, params) for mode in ("on", "off")}
        extra = seconds["on"][1] - seconds["off"][1]
        print(f"{'profiled round':<16}{'CPU s total':>14}{'in cache code':>16}")
        for mode, (total, cache) in seconds.items():
            print(f"{mode:<16}{total:>14.3f}{cache:>16.4f}")
        share = 100 * extra / seconds["off"][0]
        print(f"caching's own cost: {extra * 1e3:.1f} ms = {share:.2f}% of the round")
        result["profile_cpu_s"] = seconds
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
