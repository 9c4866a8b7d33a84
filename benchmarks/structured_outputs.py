"""What structured outputs cost: decode throughput of a batch with half its rows constrained by a
JSON schema vs none, and the per-step time of the grammar bitmask (filled on the EngineCore side,
applied in the sampler).

Every row generates exactly --output-len tokens: unconstrained rows ignore EOS, constrained rows
write one JSON string of at least 256 characters (longer than --output-len tokens can close),
so both batches do the same work but for the grammar. Runs the offline engine in this process;
timing wraps the manager's `fill_bitmask` and the sampler's `apply_token_constraints`. A second measurement
applies a bitmask to logits of Qwen2's real vocabulary (151,936) to show how the sampler part
scales with the vocabulary (the fill needs the real tokenizer, which is not here).

    python benchmarks/structured_outputs.py --preset tiny --batch 16 --output-len 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from mmserve import LLM, SamplingParams
from mmserve.layers import sampler as sampler_module
from mmserve.layers.sampler import SamplingMetadata, apply_token_constraints
from mmserve.sampling_params import StructuredOutputsParams
from mmserve.structured_output.manager import StructuredOutputManager
from mmserve.testing.checkpoints import checkpoint

SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 256}},
    "required": ["text"],
}
QWEN2_VOCAB = 151_936


class Timer:
    """Wraps a function and records each call's duration (s)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def wrap(self, function: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = function(*args, **kwargs)
            self.seconds.append(time.perf_counter() - start)
            return result

        return timed


def run_batch(llm: LLM, batch: int, output_len: int, constrained: int) -> dict:
    plain = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    json_params = SamplingParams(
        temperature=0, max_tokens=output_len, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    params = [json_params] * constrained + [plain] * (batch - constrained)
    prompts = [f"Request {i}: describe the picture." for i in range(batch)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert tokens == batch * output_len, f"{tokens} tokens, expected {batch * output_len}"
    return {
        "constrained_rows": constrained,
        "seconds": elapsed,
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
    }


def median_ms(seconds: list[float]) -> float | None:
    return 1000 * statistics.median(seconds) if seconds else None


def engine_benchmark(args: argparse.Namespace) -> dict:
    fill, apply = Timer(), Timer()
    sampler_module.apply_token_constraints = apply.wrap(sampler_module.apply_token_constraints)
    StructuredOutputManager.fill_bitmask = fill.wrap(StructuredOutputManager.fill_bitmask)
    model = checkpoint("qwen2_vl", args.preset)
    results = []
    with LLM(model, max_num_seqs=args.batch, max_num_batched_tokens=max(256, args.batch * 16)) as llm:
        run_batch(llm, args.batch, 8, args.batch // 2)  # warm-up: imports, compilation, allocations
        for _ in range(args.repeats):
            for constrained in (0, args.batch // 2):
                fill.seconds.clear()
                apply.seconds.clear()
                result = run_batch(llm, args.batch, args.output_len, constrained)
                result["fill_bitmask_ms_median"] = median_ms(fill.seconds)
                result["apply_bitmask_ms_median"] = median_ms(apply.seconds)
                results.append(result)
                print(json.dumps(result))
    return {"model": str(model), "vocab_size": llm.config.model.vocab_size, "runs": results}


def vocab_scaling(batch: int, vocab_size: int, repeats: int = 50) -> dict:
    """Median ms to apply a bitmask to half the rows of [batch, vocab] logits."""
    rows = batch // 2
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, -(-vocab_size // 32)), dtype=torch.int32)
    metadata = SamplingMetadata(
        temperature=torch.zeros(batch),
        all_greedy=True,
        all_random=False,
        grammar_bitmask=bitmask,
        grammar_rows=torch.arange(rows),
    )
    logits = torch.randn(batch, vocab_size)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        apply_token_constraints(logits.clone(), metadata)
        seconds.append(time.perf_counter() - start)
    clone = []
    for _ in range(repeats):
        start = time.perf_counter()
        logits.clone()
        clone.append(time.perf_counter() - start)
    return {
        "vocab_size": vocab_size,
        "batch": batch,
        "constrained_rows": rows,
        "apply_ms_median": median_ms(seconds) - median_ms(clone),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    results = engine_benchmark(args)
    results["vocab_scaling"] = [vocab_scaling(args.batch, v) for v in (results["vocab_size"], QWEN2_VOCAB)]
    results["load_average"] = os.getloadavg()
    print(json.dumps(results["vocab_scaling"]))
    print("load average", results["load_average"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
