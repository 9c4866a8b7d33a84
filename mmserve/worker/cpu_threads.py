"""How many CPU threads the engine runs, and which cores they are pinned to (as vLLM's CPU
backend pins its worker's OpenMP threads, `VLLM_CPU_OMP_THREADS_BIND`).

`cpu_threads_bind` (`--cpu-threads-bind`):
- `auto`: this rank's share of the CPUs the process may run on (`sched_getaffinity`), split
  evenly and in order over the tensor-parallel ranks of the machine, one thread per CPU;
- `none`: no pinning; the OS places the threads (`num_threads` of them, default this share);
- a list of CPUs such as `0-3,8`, one per rank joined by `|` (`0-1|2-3` for two ranks).
`num_threads` then takes the first that many of the rank's CPUs (default: all of them). Every
core by default, as vLLM's CPU backend uses all of a node's cores: the model's matmuls and
attention are where a step's time goes, while the API server and the preprocess workers mostly
wait (BENCHMARKS.md, "threads").
Pinned threads keep their caches and never queue two to a core while another core idles; they
also cannot move away from a neighbour's job, which is why `none` exists for shared machines.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("mmserve.worker")


def parse_cpu_list(text: str) -> list[int]:
    """`0-3,8` → [0, 1, 2, 3, 8]; raises ValueError naming the flag for anything else."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            first, dash, last = part.partition("-")
            begin, end = int(first), int(last) if dash else int(first)
            if end < begin:
                raise ValueError(part)
            cpus.extend(range(begin, end + 1))
    except ValueError:
        raise ValueError(f"--cpu-threads-bind: {text!r} is not a list of CPUs such as 0-3,8") from None
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"--cpu-threads-bind: {text!r} names a CPU twice")
    return cpus


def rank_cpus(spec: str, rank: int, world_size: int, allowed: list[int]) -> list[int] | None:
    """The CPUs rank `rank` of `world_size` pins its threads to (None: no pinning), from the
    process's `allowed` CPUs."""
    if spec == "none":
        return None
    if spec == "auto":
        share = len(allowed) // world_size
        if share == 0:
            logger.warning("%d ranks share %d CPUs: threads not pinned", world_size, len(allowed))
            return None
        return allowed[rank * share : (rank + 1) * share]
    lists = spec.split("|")
    if len(lists) != world_size:
        raise ValueError(f"--cpu-threads-bind gives {len(lists)} CPU lists for {world_size} ranks: {spec!r}")
    cpus = parse_cpu_list(lists[rank])
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise ValueError(f"--cpu-threads-bind: CPUs {outside} are not among this process's CPUs {allowed}")
    return cpus


def configure_cpu_threads(
    spec: str, num_threads: int | None, rank: int = 0, world_size: int = 1
) -> list[int] | None:
    """Set torch's thread count for this rank and pin the threads as `spec` says (module
    docstring); returns the CPUs pinned to, in thread order (None: not pinned)."""
    allowed = sorted(os.sched_getaffinity(0))
    cpus = rank_cpus(spec, rank, world_size, allowed)
    if cpus is None:
        torch.set_num_threads(num_threads or max(1, len(allowed) // world_size))
        return None
    threads = num_threads or len(cpus)
    if threads > len(cpus):
        raise ValueError(f"{threads} threads, but --cpu-threads-bind gives this rank the CPUs {cpus}")
    from mmserve.ops import cpu

    if spec == "auto" and not cpu.is_available():
        logger.warning("the C++ kernels could not be built: threads not pinned")
        torch.set_num_threads(threads)
        return None
    cpu.bind_threads(cpus[:threads])
    logger.info("engine threads pinned to CPUs %s", cpus[:threads])
    return cpus[:threads]
