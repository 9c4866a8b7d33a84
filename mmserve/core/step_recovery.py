"""Recovery from a step whose model run raised, so that only the request at fault fails.

The contract, for the EngineCore that calls `Scheduler.recover_failed_step(scheduler_output,
message)` instead of `update_from_output` when executing `scheduler_output` raised:

- Nothing the failed step computed is trusted. Blocks it filled lose their prefix-cache hashes
  (their KV may be half written) and images it encoded leave the encoder cache; what the step
  should have told the runner (dropped requests, freed images) is told again with the next step.
- A request alone in the failed step is its cause: it fails with `message`.
- Several requests are all preempted (their KV is recomputed) and *isolated*, each with the
  number of computed tokens the failed step would have brought it to. While any request is
  isolated, `schedule()` runs only the oldest one, alone, preempting the others when it needs
  their room; a successful step that takes it to its mark ends its isolation. The request at
  fault therefore raises again alone and fails by itself, while the others recompute and carry
  on with exactly the tokens they would have produced.
- A request that finishes or is aborted while isolated is no longer isolated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mmserve.core.encoder_cache_manager import EncoderCacheManager
    from mmserve.core.kv_cache_manager import KVCacheManager
    from mmserve.core.request import Request
    from mmserve.core.sched_output import SchedulerOutput


class RecoverableScheduler(Protocol):
    """What undoing a step needs of the scheduler (core/scheduler.py's `Scheduler`)."""

    requests: dict[str, Request]
    dropped_req_ids: set[str]
    encoder_cache_manager: EncoderCacheManager
    kv: KVCacheManager
    block_size: int

    def fail(self, request: Request, message: str) -> None: ...

    def preempt(self, request: Request) -> None: ...


class StepRecovery:
    """The isolation state of one scheduler, and the undoing of a failed step."""

    def __init__(self, scheduler: RecoverableScheduler) -> None:
        self.scheduler = scheduler
        # Request id → computed tokens it must reach running alone; oldest first.
        self.isolated: dict[str, int] = {}

    def next_isolated(self) -> Request | None:
        """The request to run alone this step, if a failed step left any."""
        request_id = next(iter(self.isolated), None)
        return None if request_id is None else self.scheduler.requests[request_id]

    def record_progress(self, request: Request) -> None:
        """After a step ran: a request that reached its mark is no longer isolated."""
        if self.isolated.get(request.request_id, -1) <= request.num_computed_tokens:
            self.isolated.pop(request.request_id, None)

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted."""
        self.isolated.pop(request_id, None)

    def recover(self, scheduler_output: SchedulerOutput, message: str) -> None:
        """Undo the step that `schedule` returned as `scheduler_output` (see the module's contract)."""
        scheduler = self.scheduler
        requests = scheduler.requests
        scheduler.dropped_req_ids |= scheduler_output.dropped_req_ids
        scheduler.encoder_cache_manager.return_freed(scheduler_output.free_encoder_mm_hashes)
        encoded = {
            requests[request_id].mm_features[index].mm_hash
            for request_id, indices in scheduler_output.scheduled_encoder_inputs.items()
            if request_id in requests
            for index in indices
        }
        num_scheduled = scheduler_output.num_scheduled_tokens
        step = [requests[request_id] for request_id in num_scheduled if request_id in requests]
        for request in step:
            num_computed_before = request.num_computed_tokens - num_scheduled[request.request_id]
            scheduler.kv.uncache_from(request, num_computed_before // scheduler.block_size)
        if len(step) == 1:
            scheduler.fail(step[0], message)
        else:
            for request in step:  # isolated oldest first
                self.isolated.setdefault(request.request_id, request.num_computed_tokens)
            for request in reversed(step):  # each pushed to the front: they keep their order
                scheduler.preempt(request)
        for mm_hash in encoded:
            scheduler.encoder_cache_manager.discard(mm_hash)
