"""The multiprocessing executor's contract: each step sends the workers a diff (its size does
not grow with the prompts), and a worker that dies makes the engine dead at once, leaving no
process and no socket behind."""

from __future__ import annotations

import os
import signal
import time

import pytest

from mmserve.core.sched_output import ExecutorDeadError
from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint

pytestmark = pytest.mark.timeout(180)

DECODE = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def step_sizes(llm: LLM, prompt_length: int) -> tuple[int, list[int]]:
    """(bytes of the step that sent the request, bytes of each decode step after it)."""
    executor = llm.engine_core.executor
    run_step = executor.execute_model
    sizes = []

    def recording(scheduler_output):
        output = run_step(scheduler_output)
        sizes.append((bool(scheduler_output.scheduled_new_reqs), executor.last_step_bytes))
        return output

    executor.execute_model = recording
    try:
        llm.generate({"prompt_token_ids": [100 + i % 5000 for i in range(prompt_length)]}, DECODE)
    finally:
        del executor.execute_model
    assert sizes[0][0] and not any(new for new, _ in sizes[1:])
    return sizes[0][1], [size for _, size in sizes[1:]]


def test_bytes_per_decode_step_do_not_grow_with_the_prompt():
    with LLM(checkpoint("qwen2_vl"), tensor_parallel_size=2, dtype="float32", num_kv_blocks=128) as llm:
        short_first, short_decode = step_sizes(llm, 16)
        long_first, long_decode = step_sizes(llm, 1024)
    print(f"first step {short_first} -> {long_first} bytes; decode steps {short_decode} -> {long_decode}")
    assert len(short_decode) == len(long_decode) == 7
    # the new request goes once, in full: its prompt is in the first step's message
    assert long_first - short_first > 2 * (1024 - 16)
    # then only diffs: a few bytes more at most where an integer needs a wider encoding
    assert max(long_decode) <= max(short_decode) + 16


def test_a_killed_worker_makes_the_engine_dead_within_seconds_with_nothing_left():
    llm = LLM(checkpoint("qwen2_vl"), tensor_parallel_size=2, dtype="float32", num_kv_blocks=64)
    executor = llm.engine_core.executor
    processes, sockets = list(executor.processes), executor._dir
    try:
        assert llm.generate({"prompt_token_ids": list(range(100, 140))}, DECODE)[0].outputs[0].token_ids
        os.kill(processes[1].pid, signal.SIGKILL)  # rank 0 is then left waiting in a collective
        start = time.monotonic()
        with pytest.raises(ExecutorDeadError, match=r"worker 1 .*died"):
            llm.generate({"prompt_token_ids": list(range(100, 140))}, DECODE)
        elapsed = time.monotonic() - start
    finally:
        llm.close()
    assert elapsed < 5, "the issue's contract: dead reported within 5 s"
    assert not any(p.is_alive() for p in processes)
    assert not os.path.exists(sockets)
