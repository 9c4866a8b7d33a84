"""Prefill steps of the whole model: an image request (vision tower + its prompt) and a text prompt.

    .venv/bin/python -m benchmarks.prefill_step --preset mid --dtype bfloat16 [--profile]

Each round submits one new request (a fresh synthetic image, so neither the encoder cache nor
the prefix cache helps; random token ids for the text prompt) with max_tokens=1 and times the
engine steps it takes (`EngineCore.step`: scheduler, encoder, forward, sampling; the image's
preprocessing happens before, in this process, and is not counted). Prints the median ms of
each kind. `--profile` prints the torch profiler's top operators (self CPU time) over one more
image round: where a step's time goes.
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.reference import png_bytes, synthetic_image

PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


def timed_steps(llm: LLM, run: Callable[[], object]) -> float:
    """Seconds spent inside EngineCore.step while `run()` drives the engine."""
    core = llm.engine_core
    original, spent = core.step, [0.0]

    def step():
        start = time.perf_counter()
        try:
            return original()
        finally:
            spent[0] += time.perf_counter() - start

    core.step = step
    try:
        run()
    finally:
        del core.step  # back to the class's method
    return spent[0]


def image_round(llm: LLM, seed: int, size: tuple[int, int]) -> float:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(synthetic_image(*size, seed=seed))).decode()
    parts = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "Describe the image."},
    ]
    return timed_steps(llm, lambda: llm.chat([{"role": "user", "content": parts}], PARAMS))


def text_round(llm: LLM, seed: int, tokens: int) -> float:
    ids = np.random.default_rng(seed).integers(100, 11000, tokens).tolist()
    return timed_steps(llm, lambda: llm.generate({"prompt_token_ids": ids}, PARAMS))


def profile_image_round(llm: LLM, size: tuple[int, int], rows: int = 15) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        image_round(llm, seed=10_000, size=size)
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen2_vl")
    parser.add_argument("--preset", default="mid")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--image-size", type=int, nargs=2, default=[448, 336])
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    llm = LLM(
        checkpoint(args.family, args.preset),
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
    )
    size = tuple(args.image_size)
    image_round(llm, seed=0, size=size)  # warm-up: first calls allocate and pick kernels
    text_round(llm, seed=0, tokens=args.text_tokens)
    image_s = [image_round(llm, seed=1 + r, size=size) for r in range(args.rounds)]
    text_s = [text_round(llm, seed=1 + r, tokens=args.text_tokens) for r in range(args.rounds)]
    print(
        f"{args.family}-{args.preset} {llm.config.model.dtype} "
        f"backend={llm.engine_core.executor.runner.attention_backend.name} "
        f"threads={torch.get_num_threads()} load={os.getloadavg()[0]:.2f}"
    )
    print(f"image {size[0]}x{size[1]} request, steps: {1e3 * statistics.median(image_s):.1f} ms (median)")
    print(f"text {args.text_tokens}-token prefill, steps: {1e3 * statistics.median(text_s):.1f} ms (median)")
    if args.profile:
        profile_image_round(llm, size)
    llm.close()


if __name__ == "__main__":
    main()
