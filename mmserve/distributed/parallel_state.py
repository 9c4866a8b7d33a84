"""The process's tensor-parallel group and the collectives the layers use.

Every process has exactly one current group. Until `init_tensor_parallel` is called it is the
single-rank group, whose collectives return their input: the one-device path runs the same layer
code with no torch.distributed at all. A worker process of a tensor-parallel engine joins a
group of `world_size` ranks once, before it builds its model, and keeps it for its lifetime (as
vLLM's parallel_state does).

Each collective counts the calls and payload bytes it moved (`stats`), so the per-step
communication of a run can be measured without a profiler.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Cumulative collective calls and the bytes of their input tensors, per operation."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def record(self, op: str, tensor: torch.Tensor) -> None:
        self.calls[op] += 1
        self.bytes[op] += tensor.numel() * tensor.element_size()


class TensorParallelGroup:
    """One rank's view of its tensor-parallel group. With `world_size` 1 every collective is the
    identity; otherwise `process_group` must be a torch.distributed group of that size."""

    def __init__(self, rank: int, world_size: int, process_group: dist.ProcessGroup | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a group of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.process_group = process_group
        self.stats = CommStats()

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def _group(self) -> dist.ProcessGroup:
        if self.process_group is None:
            raise RuntimeError(
                f"rank {self.rank} of {self.world_size} has no process group to communicate on"
            )
        return self.process_group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place (every rank gets it)."""
        if self.world_size == 1:
            return x
        self.stats.record("all_reduce", x)
        dist.all_reduce(x, group=self._group())
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's `x` (all the same shape) concatenated along `dim`, on every rank."""
        if self.world_size == 1:
            return x
        self.stats.record("all_gather", x)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self._group())
        return torch.cat(parts, dim=dim)


SINGLE_RANK = TensorParallelGroup(0, 1)
"""The group of one: what layers built for data parallelism (a replicated vision tower) use."""

_current = SINGLE_RANK


def get_tp_group() -> TensorParallelGroup:
    return _current


@dataclass(frozen=True)
class DistributedInit:
    """Where and how one rank joins its group: the TCPStore that the executor hosts (so no port is
    guessed), this rank, the group size, and the torch.distributed backend."""

    store_host: str
    store_port: int
    rank: int
    world_size: int
    backend: str  # "gloo" | "nccl"
    timeout_s: float = 600.0


def host_store(host: str) -> dist.TCPStore:
    """The rendezvous store the ranks join, on a port the OS picks (`.port`); the executor holds
    it for the engine's lifetime."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)


def init_tensor_parallel(init: DistributedInit) -> TensorParallelGroup:
    """Join the group described by `init` (once per process) and make it current."""
    global _current
    if _current.world_size > 1:
        raise RuntimeError("this process already belongs to a tensor-parallel group")
    timeout = timedelta(seconds=init.timeout_s)
    store = dist.TCPStore(init.store_host, init.store_port, init.world_size, is_master=False, timeout=timeout)
    dist.init_process_group(
        init.backend, store=store, rank=init.rank, world_size=init.world_size, timeout=timeout
    )
    _current = TensorParallelGroup(init.rank, init.world_size, dist.group.WORLD)
    return _current


def destroy_tensor_parallel() -> None:
    global _current
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = SINGLE_RANK


@contextlib.contextmanager
def use_tp_group(group: TensorParallelGroup) -> Iterator[TensorParallelGroup]:
    """Make `group` current for the block: for tests that build one rank's shard of a model
    (loading needs no communication) without joining a real group."""
    global _current
    previous, _current = _current, group
    try:
        yield group
    finally:
        _current = previous
