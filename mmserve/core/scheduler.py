"""The scheduler: one token budget per step, shared by prompt and generated tokens.

Each step decides {request_id: num_tokens}. Running requests go first, each asking for all the
tokens it has not computed yet (one, once decoding; the rest of its prompt while prefilling),
capped by the step budget; then waiting requests are admitted in queue order, starting after
their longest cached prefix. Chunked prefill is simply a request receiving fewer tokens than it
has left. Images add one rule: a span that reaches an image not in the encoder cache encodes the
whole image this step, from the pixels the request holds, if the encoder budget and cache
allow, else stops just before it (span_plan.py). When KV blocks run out, a running request is
preempted and later recomputed.
A request with structured outputs waits for its grammar to compile before it is queued, and
its tokens then advance its grammar's matcher (grammar.py).

Which waiting request comes next, where it joins the running list and which running request is
preempted are the scheduling policy's choices (request_queue.py: FCFS or priority). A step whose
model run raised is undone and replayed one request at a time (step_recovery.py).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.core.encoder_cache_manager import EncoderCacheManager
from mmserve.core.grammar import GrammarGate, GrammarTracker
from mmserve.core.kv_cache_manager import KVCacheManager
from mmserve.core.request import Request, RequestStatus
from mmserve.core.request_queue import create_request_queue
from mmserve.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from mmserve.core.schedulable import check_schedulable
from mmserve.core.span_plan import SpanPlan, plan_span
from mmserve.core.step_recovery import StepRecovery
from mmserve.core.stopping import append_until_stop, engine_output, unsent_prompt_logprobs
from mmserve.protocol import EngineCoreOutput, EngineCoreOutputs, SchedulerStats

if TYPE_CHECKING:
    import numpy as np


@dataclass
class _Step:
    """What one `schedule()` call has decided so far, and the budgets it has left."""

    token_budget: int
    encoder_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    encoder_pixels: dict[str, np.ndarray] = field(default_factory=dict)  # mm_hash → what to encode
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: CachedRequestData = field(default_factory=CachedRequestData)
    preempted: bool = False


class _Admission(enum.Enum):
    ADMITTED = enum.auto()
    NO_TOKENS = enum.auto()  # the budgets or the encoder cache allow it no token this step
    NO_BLOCKS = enum.auto()


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        encoder_budget: int,
        encoder_cache_size: int,
        grammar: GrammarTracker | None = None,
    ) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.encoder_budget = encoder_budget
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.encoder_cache_manager = EncoderCacheManager(encoder_cache_size)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.scheduling_policy)
        self.running: list[Request] = []
        # Finished, aborted or preempted since the last step: the runner drops their state.
        self.dropped_req_ids: set[str] = set()
        self._runner_has: set[str] = set()  # requests whose state the runner holds
        self.num_preemptions = 0
        self._error_outputs: list[EngineCoreOutput] = []  # failures found while scheduling
        self.step_recovery = StepRecovery(self)
        self.num_encoder_runs = 0
        self.grammar = GrammarGate(grammar)

    # ------------------------------------------------------------------ admission

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError if it could never be scheduled."""
        check_schedulable(
            request,
            max_model_len=self.max_model_len,
            encoder_item_limit=min(self.encoder_budget, self.encoder_cache_manager.cache_size),
            block_size=self.block_size,
            num_blocks=self.kv.pool.num_blocks,
        )
        if self.grammar.is_structured(request):
            self.grammar.add(request)  # queued once its grammar has compiled
        else:
            self.waiting.push(request)
        self.requests[request.request_id] = request

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                outputs.append(EngineCoreOutput(request_id, [], finish_reason="abort"))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self.grammar.compiling)

    def _queue_compiled(self) -> None:
        """Queue the structured requests whose grammar has compiled; fail those it could not."""
        for request, error in self.grammar.take_compiled():
            if error is None:
                self.waiting.push(request)
            else:
                self.fail(request, error)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """Each step gives requests tokens so that their `num_computed_tokens` catch up with their
        `num_tokens`: running requests first, in order, then waiting ones admitted in queue order
        after their longest cached prefix, all under one token budget. Prompt and generated tokens
        are the same kind of thing: there are no prefill and decode phases, and chunked prefill is
        a request receiving fewer tokens than it has left."""
        self._queue_compiled()
        step = _Step(self.config.max_num_batched_tokens, self.encoder_budget)
        isolated = self.step_recovery.next_isolated()
        if isolated is not None:  # a failed step is being replayed, one request at a time
            self._schedule_isolated(step, isolated)
        else:
            self._schedule_running(step)
            if not step.preempted:  # a step that had to preempt has no room to admit
                self._schedule_waiting(step)
        return self._emit(step)

    def _schedule_running(self, step: _Step) -> None:
        index = 0
        while index < len(self.running) and step.token_budget > 0:
            if self._schedule_running_request(step, index):
                index += 1

    def _schedule_running_request(self, step: _Step, index: int) -> bool:
        """Schedule `running[index]`, preempting from the requests not yet served this step (it or
        later ones) when blocks run out. False when it left `running` (preempted or failed)."""
        request = self.running[index]
        plan = self._plan_span(request, request.num_computed_tokens, step)
        if plan.num_new_tokens == 0:
            return True
        new_block_ids = self.kv.allocate_slots(request, plan.num_new_tokens)
        if new_block_ids is None and len(self.running) == 1:
            # Alone and still out of blocks: recomputing would need the same blocks again.
            self._fail_out_of_blocks(request)
            return False
        while new_block_ids is None:
            victim = self.waiting.choose_victim(self.running[index:])
            self.preempt(victim)
            step.preempted = True
            if victim is request:
                return False
            new_block_ids = self.kv.allocate_slots(request, plan.num_new_tokens)
        self._commit(step, request, plan, new_block_ids)
        return True

    def _schedule_waiting(self, step: _Step) -> None:
        while self.waiting and step.token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            if self._try_admit(step, self.waiting.peek()) is not _Admission.ADMITTED:
                return

    def _try_admit(self, step: _Step, request: Request) -> _Admission:
        """Schedule a waiting request from the end of its longest cached prefix on."""
        hit_blocks, num_hit = self.kv.get_computed_blocks(request)
        plan = self._plan_span(request, num_hit, step)
        if plan.num_new_tokens == 0:
            return _Admission.NO_TOKENS
        new_block_ids = self.kv.allocate_slots(request, plan.num_new_tokens, hit_blocks)
        if new_block_ids is None:
            return _Admission.NO_BLOCKS
        self.waiting.remove(request)
        self.kv.record_prefix_lookup(request.num_tokens, num_hit)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
            request.first_scheduled_time = time.monotonic()
        self.waiting.add_running(self.running, request)
        self._commit(step, request, plan, new_block_ids)
        return _Admission.ADMITTED

    def _schedule_isolated(self, step: _Step, request: Request) -> None:
        """Schedule `request` alone (see step_recovery), taking from the others what it needs."""
        if request.status == RequestStatus.RUNNING:
            self._schedule_running_request(step, self.running.index(request))
        elif len(self.running) < self.config.max_num_seqs:
            while self._try_admit(step, request) is _Admission.NO_BLOCKS:
                if not self.running:
                    self._fail_out_of_blocks(request)
                    break
                self.preempt(self.waiting.choose_victim(self.running))
        if not step.num_scheduled_tokens:
            # What it needs (encoder cache room, blocks, a seat) is held by requests that cannot run now.
            for victim in [r for r in reversed(self.running) if r is not request]:
                self.preempt(victim)

    def _commit(self, step: _Step, request: Request, plan: SpanPlan, new_block_ids: list[int]) -> None:
        """Take a request's planned span into the step: its images, its tokens, and what the
        runner is told (everything if it does not hold the request yet, else what changed)."""
        self._apply_encoder_plan(request, plan, step)
        step.encoder_budget = plan.encoder_budget
        step.num_scheduled_tokens[request.request_id] = plan.num_new_tokens
        step.token_budget -= plan.num_new_tokens
        if request.request_id in self._runner_has:
            step.cached_requests.req_ids.append(request.request_id)
            step.cached_requests.new_block_ids.append(new_block_ids)
            step.cached_requests.num_computed_tokens.append(request.num_computed_tokens)
        else:
            step.new_requests.append(self._new_request_data(request))

    def _emit(self, step: _Step) -> SchedulerOutput:
        """The step's SchedulerOutput; from here on, the requests count its tokens as computed."""
        output = SchedulerOutput(
            scheduled_new_reqs=step.new_requests,
            scheduled_cached_reqs=step.cached_requests,
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(step.num_scheduled_tokens.values()),
            scheduled_encoder_inputs=step.encoder_inputs,
            encoder_pixels=step.encoder_pixels,
            dropped_req_ids=self.dropped_req_ids,
            free_encoder_mm_hashes=self.encoder_cache_manager.take_freed(),
        )
        self.dropped_req_ids = set()
        sampling = []
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens >= request.num_tokens:
                sampling.append(request)
        self._runner_has.update(step.num_scheduled_tokens)
        output.grammar_bitmask = self.grammar.bitmask(sampling)
        return output

    def _plan_span(self, request: Request, num_computed: int, step: _Step) -> SpanPlan:
        """All the tokens the request has not computed, within the budgets and the prefill cap."""
        num_new = min(request.num_tokens - num_computed, step.token_budget)
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_new = min(num_new, threshold)
        return plan_span(self.encoder_cache_manager, request, num_computed, num_new, step.encoder_budget)

    def _apply_encoder_plan(self, request: Request, plan: SpanPlan, step: _Step) -> None:
        """Reference the cached items the span reads, reserve the ones it encodes; the pixels of
        those go with the step (the runner needs them this step only)."""
        request_id = request.request_id
        for index in plan.to_reference:  # first, so that allocating cannot evict them
            self.encoder_cache_manager.add_reference(request.mm_features[index].mm_hash, request_id)
        for index in plan.to_encode:
            f = request.mm_features[index]
            self.encoder_cache_manager.allocate(f.mm_hash, f.length, request_id)
            pixels = request.mm_pixels.get(f.mm_hash)
            if pixels is not None:
                step.encoder_pixels[f.mm_hash] = pixels
        if plan.to_encode:
            step.encoder_inputs[request_id] = plan.to_encode
            self.num_encoder_runs += len(plan.to_encode)

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            mm_features=request.mm_features,
            sampling_params=request.sampling_params,
            block_ids=self.kv.block_ids(request),
            num_computed_tokens=request.num_computed_tokens,
            output_token_ids=list(request.output_token_ids),
        )

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks and images; it recomputes from the start when readmitted."""
        self.running.remove(request)
        self._release_resources(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)

    # ------------------------------------------------------------------ after the model ran

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append the tokens the runner sampled for `scheduler_output`, finish the requests that
        stop, and release the images the requests have computed past."""
        outputs = self.take_error_outputs()
        for request_id, new_tokens in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            self.step_recovery.record_progress(request)
            self._release_passed_images(request)
            prompt_logprobs = unsent_prompt_logprobs(request, runner_output.prompt_logprobs.get(request_id))
            if new_tokens or prompt_logprobs:  # no tokens mid-prefill
                appended = append_until_stop(request, new_tokens, self.grammar, self.max_model_len)
                if appended.finish is not None:
                    self._finish(request, appended.finish)
                outputs.append(engine_output(request, appended, runner_output.logprobs.get(request_id)))
                outputs[-1].new_prompt_logprobs = prompt_logprobs
        return EngineCoreOutputs(outputs=outputs, stats=self.stats())

    def take_error_outputs(self) -> list[EngineCoreOutput]:
        outputs, self._error_outputs = self._error_outputs, []
        return outputs

    def recover_failed_step(self, scheduler_output: SchedulerOutput, message: str) -> None:
        """Undo a step whose model run raised, after `schedule` returned `scheduler_output`; the
        contract is in step_recovery.py."""
        self.step_recovery.recover(scheduler_output, message)

    def _release_passed_images(self, request: Request) -> None:
        """Keep references only to images the request is in the middle of. An image repeated later
        in the prompt is referenced again when reached (a hit while it stays cached): holding it
        across the gap could fill the cache with images that requests wait on each other to pass."""
        num_computed = request.num_computed_tokens
        inside = {f.mm_hash for f in request.mm_features if f.offset < num_computed < f.offset + f.length}
        for f in request.mm_features:
            if f.offset < num_computed and f.mm_hash not in inside:
                self.encoder_cache_manager.release(f.mm_hash, request.request_id)

    def fail(self, request: Request, message: str) -> None:
        """Finish a request with an error, reported with the next outputs."""
        self._finish(request, RequestStatus.FINISHED_ERROR)
        self._error_outputs.append(
            EngineCoreOutput(request.request_id, [], finish_reason="error", error=message)
        )

    def _fail_out_of_blocks(self, request: Request) -> None:
        self.fail(request, f"the KV cache ({self.kv.pool.num_blocks} blocks) cannot hold this request")

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.step_recovery.forget(request.request_id)
        was_compiling = self.grammar.discard(request)
        if request in self.running:
            self.running.remove(request)
        elif not was_compiling:
            self.waiting.remove(request)
        self._release_resources(request)
        del self.requests[request.request_id]

    def _release_resources(self, request: Request) -> None:
        self.kv.free(request)
        self.encoder_cache_manager.release_all(request.request_id, [f.mm_hash for f in request.mm_features])
        if request.request_id in self._runner_has:
            self._runner_has.discard(request.request_id)
            self.dropped_req_ids.add(request.request_id)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            kv_blocks_in_use=self.kv.num_used_blocks,
            prefix_cache_queries=self.kv.prefix_stats.queries,
            prefix_cache_hits=self.kv.prefix_stats.hits,
            encoder_runs=self.num_encoder_runs,
            encoder_cache_hits=self.encoder_cache_manager.num_hits,
            encoder_cache_references=self.encoder_cache_manager.num_references(),
            num_preemptions=self.num_preemptions,
        )
