"""Which CPUs the engine's threads are pinned to, and that pinning really pins them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmserve.config import ExecutionConfig
from mmserve.engine_args import EngineArgs
from mmserve.worker.cpu_threads import parse_cpu_list, rank_cpus


def test_cpu_lists_parse_ranges_and_single_cpus() -> None:
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list("5") == [5]


@pytest.mark.parametrize("text", ["", "a", "0-", "1,1", "3-1", "0,,2"])
def test_malformed_cpu_lists_are_refused_naming_the_flag(text: str) -> None:
    with pytest.raises(ValueError, match="--cpu-threads-bind"):
        parse_cpu_list(text)


def test_auto_splits_the_allowed_cpus_evenly_over_the_ranks() -> None:
    allowed = [0, 1, 2, 3, 4, 5, 6]
    assert rank_cpus("auto", 0, 1, allowed) == allowed
    assert rank_cpus("auto", 0, 2, allowed) == [0, 1, 2]
    assert rank_cpus("auto", 1, 2, allowed) == [3, 4, 5]
    assert rank_cpus("auto", 0, 8, allowed) is None  # fewer CPUs than ranks: not pinned


def test_explicit_lists_are_per_rank_and_within_the_allowed_cpus() -> None:
    allowed = [0, 1, 2, 3]
    assert rank_cpus("0-1|2-3", 1, 2, allowed) == [2, 3]
    assert rank_cpus("none", 0, 1, allowed) is None
    with pytest.raises(ValueError, match="2 CPU lists for 1 ranks"):
        rank_cpus("0|1", 0, 1, allowed)
    with pytest.raises(ValueError, match=r"CPUs \[7\] are not among"):
        rank_cpus("0,7", 0, 1, allowed)


def test_the_config_refuses_what_is_no_binding() -> None:
    with pytest.raises(ValueError, match="cpu_threads_bind"):
        ExecutionConfig(cpu_threads_bind="cores")


PROBE = """
import json, os, torch
from mmserve.worker.cpu_threads import configure_cpu_threads
pinned = configure_cpu_threads({spec!r}, None)
torch.ones(1 << 22).sum()  # a parallel region: the pool's threads exist and ran
affinity = {{}}
for tid in os.listdir("/proc/self/task"):
    affinity[tid] = sorted(os.sched_getaffinity(int(tid)))
print(json.dumps({{"pinned": pinned, "threads": torch.get_num_threads(), "main": affinity[str(os.getpid())],
                  "all": list(affinity.values())}}))
"""


def probe(spec: str) -> dict:
    """configure_cpu_threads(spec) in a fresh process (pinning this one would pin the suite)."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(spec=spec)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_auto_pins_one_thread_to_each_cpu_the_process_may_use() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    seen = probe("auto")
    assert seen["pinned"] == allowed
    assert seen["threads"] == len(allowed)
    assert seen["main"] == [allowed[0]]  # the caller is thread 0
    single = {cpus[0] for cpus in seen["all"] if len(cpus) == 1}
    assert single == set(allowed)  # every CPU has its thread


def test_none_leaves_every_thread_where_the_os_puts_it() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    seen = probe("none")
    assert seen["pinned"] is None
    assert all(cpus == allowed for cpus in seen["all"])


def test_cpu_lists_are_refused_for_a_cuda_engine() -> None:
    demo = Path(__file__).resolve().parents[3] / "assets" / "demo-model"
    with pytest.raises(ValueError, match="--cpu-threads-bind 0-1 pins the threads of a CPU engine"):
        EngineArgs(model=demo, device="cuda", cpu_threads_bind="0-1").create_engine_config()
    assert EngineArgs(model=demo, device="cpu", cpu_threads_bind="0-1").create_engine_config()
