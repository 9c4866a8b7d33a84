"""The one worker in the EngineCore's own process (one rank): nothing is sent anywhere."""

from __future__ import annotations

from typing import Any

from mmserve.config import EngineConfig
from mmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from mmserve.executor.abstract import Executor
from mmserve.executor.worker_factory import build_worker


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.worker = build_worker(config)
        self.runner = self.worker.runner  # the tests and benchmarks reach into the one runner
        self.num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_kv_cache(self.num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def check_health(self) -> None:
        """The worker is this process: nothing can die apart from it."""

    def shutdown(self) -> None:
        """Nothing runs apart from this process."""
