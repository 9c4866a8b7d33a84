"""EngineCore: the busy loop's body. Schedule, execute, update — nothing else.

It owns the scheduler and talks to an executor (the worker, in this process or another)
through the SchedulerOutput / ModelRunnerOutput contract only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from mmserve.core.request import Request
from mmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from mmserve.core.scheduler import Scheduler
from mmserve.protocol import EngineCoreOutput, EngineCoreOutputs, EngineRequest


class Executor(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self._pending: list[EngineCoreOutput] = []  # rejections and aborts, sent with the next step

    def add_request(self, engine_request: EngineRequest) -> None:
        """Queue a request; one that can never run is answered with an error output instead."""
        request = Request(
            engine_request.request_id,
            engine_request.prompt_token_ids,
            engine_request.mm_features,
            engine_request.sampling_params,
            self.scheduler.block_size,
            engine_request.arrival_time,
            engine_request.priority,
        )
        try:
            self.scheduler.add_request(request)
        except ValueError as e:
            self._pending.append(
                EngineCoreOutput(engine_request.request_id, [], finish_reason="error", error=str(e))
            )

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self._pending.extend(self.scheduler.abort_requests(request_ids))

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    def step(self) -> EngineCoreOutputs:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self._pending:
            outputs.outputs[:0] = self._pending
            self._pending = []
        return outputs
