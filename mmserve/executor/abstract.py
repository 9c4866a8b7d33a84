"""The executor interface the EngineCore steps through (`factory.create_executor` chooses one).

An executor owns the workers (one per tensor-parallel rank), knows how many KV blocks every rank
can hold (`num_blocks`, the smallest count over the ranks), runs one step on all ranks and
returns rank 0's output, and calls a worker method on every rank (`collective_rpc`). A failure
that leaves the ranks unable to go on raises `ExecutorDeadError`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from mmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput


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
