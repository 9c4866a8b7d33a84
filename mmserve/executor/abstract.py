"""The executor interface the EngineCore steps through, and the choice of executor.

An executor owns the workers (one per tensor-parallel rank), knows how many KV blocks every rank
can hold (`num_blocks`, the smallest count over the ranks), runs one step on all ranks and
returns rank 0's output, and calls a worker method on every rank (`collective_rpc`). A failure
that leaves the ranks unable to go on raises `ExecutorDeadError`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from mmserve.config import EngineConfig
from mmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from mmserve.executor.worker_factory import on_cuda


class Executor(ABC):
    num_blocks: int
    # bytes sent to the workers: by the last step, and over the executor's life
    last_step_bytes: int = 0
    total_step_bytes: int = 0

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """`Worker.<method>(*args)` on every rank; the results in rank order."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise `ExecutorDeadError` if a worker is gone (called while the engine is idle, so a
        death is reported without waiting for the next step)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and free what the executor holds; safe to call twice."""


def create_executor(config: EngineConfig) -> Executor:
    """The executor `config.parallel` asks for (refusing combinations that cannot run)."""
    parallel = config.parallel
    backend = parallel.executor_backend
    if on_cuda(config) and backend == "mp" and parallel.world_size > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size {parallel.world_size} needs as many GPUs; "
            f"this machine has {torch.cuda.device_count()} (use the ray backend to span machines)"
        )
    if backend == "uni":
        from mmserve.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config)
    if backend == "mp":
        from mmserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from mmserve.executor.ray_executor import RayExecutor

    return RayExecutor(config)
