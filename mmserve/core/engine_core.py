"""EngineCore: the busy loop's body. Schedule, execute, update — nothing else.

It owns the scheduler and talks to an executor (the worker, in this process or another)
through the SchedulerOutput / ModelRunnerOutput contract only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from mmserve.core.pixel_store import MissingPixels, PixelStore
from mmserve.core.request import Request
from mmserve.core.sched_output import ExecutorDeadError, ModelRunnerOutput, SchedulerOutput
from mmserve.core.scheduler import Scheduler
from mmserve.protocol import EngineCoreOutput, EngineCoreOutputs, EngineRequest, MultiModalFeature

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger("mmserve.engine_core")


class Executor(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, vocab_size: int | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.vocab_size = vocab_size  # the model's: token ids at or past it would index past the logits
        self.pixel_store = PixelStore()  # mm_hash → pixels, as the frontend's mirror decides
        self._pending: list[EngineCoreOutput] = []  # rejections and aborts, sent with the next step
        self._released_handles: list[int] = []  # pixel handles read since the last outputs
        self._unreadable: list[str] = []  # hashes whose handles could not be read, since then
        self.last_step_tokens = 0  # tokens the last step scheduled (0: its requests all wait)

    def add_request(self, engine_request: EngineRequest) -> None:
        """Queue a request; one that can never run is answered with an error output instead.
        Its pixel-store changes are applied first, whatever becomes of the request (the frontend
        has applied them to its mirror), and the request keeps its items' pixels for its life."""
        arrival = self.pixel_store.apply(engine_request)
        self._released_handles += arrival.released_handles
        self._unreadable += arrival.unreadable
        try:
            pixels = self.pixel_store.pixels_of(engine_request.mm_features)
            check_features(engine_request.mm_features, len(engine_request.prompt_token_ids), pixels)
            if self.vocab_size is not None:
                check_token_ids(engine_request, self.vocab_size)
            request = Request(
                engine_request.request_id,
                engine_request.prompt_token_ids,
                engine_request.mm_features,
                engine_request.sampling_params,
                self.scheduler.block_size,
                engine_request.arrival_time,
                engine_request.priority,
                mm_pixels=pixels,
            )
            self.scheduler.add_request(request)
        except ValueError as e:
            if isinstance(e, MissingPixels):
                logger.error("request %s: %s", engine_request.request_id, e)
            self._pending.append(
                EngineCoreOutput(engine_request.request_id, [], finish_reason="error", error=str(e))
            )

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self._pending.extend(self.scheduler.abort_requests(request_ids))

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(
            self._pending or self._released_handles or self._unreadable
        )

    def step(self) -> EngineCoreOutputs:
        scheduler_output = self.scheduler.schedule()
        self.last_step_tokens = scheduler_output.total_num_scheduled_tokens
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except ExecutorDeadError:
            # no step can run any more: the engine is dead, not one step; stop what is left
            logger.error("the executor is dead; the engine stops")
            self.executor.shutdown()
            raise
        except Exception as e:
            # A fault in one step must not take the engine down, nor fail requests that merely
            # shared the step with the one at fault: the scheduler undoes the step and isolates.
            logger.exception(
                "model execution failed in a step of %d requests", len(scheduler_output.num_scheduled_tokens)
            )
            self.scheduler.recover_failed_step(
                scheduler_output, f"internal error while running the model: {type(e).__name__}"
            )
            return self._outputs(self.scheduler.take_error_outputs())
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self._pending:
            outputs.outputs[:0] = self._pending
            self._pending = []
        return self._with_image_news(outputs)

    def check_health(self) -> None:
        """Raise ExecutorDeadError (after stopping what is left) if the executor lost a worker."""
        try:
            self.executor.check_health()
        except ExecutorDeadError:
            self.executor.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop the executor's workers (processes, sockets); the engine runs no more steps."""
        self.executor.shutdown()

    def _outputs(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        """`outputs` after the pending ones, with the scheduler's stats."""
        result = EngineCoreOutputs(outputs=self._pending + outputs, stats=self.scheduler.stats())
        self._pending = []
        return self._with_image_news(result)

    def _with_image_news(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """What the frontend needs to know about images: which pixel handles it may unpin, and
        which it sent could not be read (for its mirror of the pixel store)."""
        outputs.released_pixel_handles, self._released_handles = self._released_handles, []
        outputs.unreadable_pixels, self._unreadable = self._unreadable, []
        return outputs


def check_token_ids(request: EngineRequest, vocab_size: int) -> None:
    """Every token id the request carries is in the vocabulary (ValueError otherwise). The API
    server refuses such requests already; this keeps any other sender from raising in a step."""
    if any(not 0 <= token < vocab_size for token in request.prompt_token_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    request.sampling_params.check_token_ids(vocab_size)


def check_features(
    features: list[MultiModalFeature], num_prompt_tokens: int, pixels: dict[str, np.ndarray]
) -> None:
    """Reject image metadata that could not have come from the preprocessor: placeholder runs
    outside the prompt or overlapping, or pixels (by mm_hash) that do not match the patch grid."""
    end = 0
    for f in sorted(features, key=lambda f: f.offset):
        t, h, w = f.grid_thw
        if f.length < 1 or f.offset < end or f.offset + f.length > num_prompt_tokens:
            raise ValueError(f"image placeholder span ({f.offset}, {f.length}) does not fit the prompt")
        if min(t, h, w) < 1 or (t * h * w) % f.length:
            raise ValueError(f"image grid {f.grid_thw} does not match its {f.length} placeholder tokens")
        item = pixels[f.mm_hash]
        if item.ndim != 2 or item.shape[0] != t * h * w:
            raise ValueError(f"image pixels of shape {item.shape} do not match its grid {f.grid_thw}")
        end = f.offset + f.length
