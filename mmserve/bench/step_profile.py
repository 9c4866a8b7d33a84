"""Where an engine step's time goes: the VisionArena workload through the offline engine, with
timers around each stage (the engine's code is wrapped at run time, not changed).

    python -m mmserve.bench.step_profile MODEL_DIR --dataset-path DIR --num-prompts 32 --max-num-seqs 8

Stages: frontend (chat template, tokenise, image load + preprocess), scheduler (schedule +
update_from_output), input prep (runner state update + step tensors + embedding gather),
encoder (vision tower), forward (language model), sampler, detokenise (output processing).
Inline preprocessing (no worker processes) so every stage runs on this thread and adds up.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict

STAGES = ("frontend", "scheduler", "input prep", "encoder", "forward", "sampler", "detokenise")


class StageTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner: object, attr: str, stage: str) -> None:
        """Replace owner.attr (a bound method or callable) with a timed call counted under `stage`."""
        inner = getattr(owner, attr)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[stage] += time.perf_counter() - t0
                self.calls[stage] += 1

        setattr(owner, attr, timed)


def instrument(llm) -> StageTimer:
    import mmserve.worker.model_runner as model_runner_module

    timer = StageTimer()
    core = llm.engine_core
    runner = core.executor.runner
    timer.wrap(llm._inputs, "chat", "frontend")
    timer.wrap(llm._outputs, "process_outputs", "detokenise")
    timer.wrap(core.scheduler, "schedule", "scheduler")
    timer.wrap(core.scheduler, "update_from_output", "scheduler")
    timer.wrap(runner, "_update_states", "input prep")
    timer.wrap(model_runner_module, "prepare_step_inputs", "input prep")
    timer.wrap(runner, "_embed", "input prep")
    timer.wrap(runner, "_run_encoder", "encoder")
    timer.wrap(runner.model, "forward", "forward")
    timer.wrap(runner, "_sample", "sampler")
    timer.wrap(core, "step", "step")
    return timer


def main(argv: list[str] | None = None) -> int:
    from mmserve.bench.dataset import load_conversations
    from mmserve.bench.workload import sample_single_turn
    from mmserve.entrypoints.llm import LLM
    from mmserve.sampling_params import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--dataset-path", required=True)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=8, help="Stands in for the client's concurrency.")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    requests = sample_single_turn(load_conversations(args.dataset_path), args.num_prompts + 2, args.seed)
    conversations = [[r.message()] for r in requests]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm = LLM(
        args.model_dir,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        preprocess_workers=0,
    )
    llm.chat(conversations[args.num_prompts :], params)  # warm-up on rows not measured
    conversations = conversations[: args.num_prompts]
    timer = instrument(llm)
    t0 = time.perf_counter()
    outputs = llm.chat(conversations, params)
    wall = time.perf_counter() - t0
    steps = timer.calls["step"]
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{len(outputs)} requests, {num_tokens} output tokens, {steps} engine steps, {wall:.2f} s wall")
    print(f"{'stage':<12}{'total s':>9}{'% wall':>8}{'ms/step':>9}")
    for stage in STAGES:
        s = timer.seconds[stage]
        print(f"{stage:<12}{s:>9.2f}{100 * s / wall:>8.1f}{1000 * s / max(steps, 1):>9.2f}")
    rest = wall - sum(timer.seconds[s] for s in STAGES)
    print(f"{'other':<12}{rest:>9.2f}{100 * rest / wall:>8.1f}{1000 * rest / max(steps, 1):>9.2f}")
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
