"""The scheduler: one token budget per step, shared by prompt and generated tokens.

Each step decides {request_id: num_tokens}. Running requests go first (in admission order, or
most urgent first under the priority policy), each asking for all the tokens it has not computed
yet (one, once decoding; the rest of its prompt while prefilling), capped by the step budget;
then waiting requests are admitted in queue order, starting after their longest cached prefix.
Chunked prefill is simply a request receiving fewer tokens than it has left. Images add one rule:
a span that reaches an image not in the encoder cache encodes the whole image this step if the
encoder budget and cache allow, else stops just before it. When KV blocks run out, the
lowest-priority running request is preempted and later recomputed.

A step whose model run raised is undone (`recover_failed_step`): alone, its request is the
cause and fails; with others, its requests are recomputed one at a time, each alone, up to where
that step reached, so that only the request that raises again fails and the rest carry on.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.core.encoder_cache_manager import EncoderCacheManager
from mmserve.core.kv_cache_manager import KVCacheManager
from mmserve.core.request import Request, RequestStatus
from mmserve.core.request_queue import RequestQueue
from mmserve.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from mmserve.protocol import EngineCoreOutput, EngineCoreOutputs, Logprobs, SchedulerStats


@dataclass
class _EncoderPlan:
    """What scheduling a span needs from the encoder cache, applied only if the span is kept."""

    num_new_tokens: int
    to_encode: list[int]  # feature indices to encode this step
    to_reference: list[int]  # feature indices already cached
    encoder_budget: int  # what remains of the step's encoder budget afterwards


def _urgency(request: Request) -> tuple[int, float]:
    """Sort key under the priority policy: lower runs first (priority, then arrival)."""
    return request.priority, request.arrival_time


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        encoder_budget: int,
        encoder_cache_size: int,
        priority_policy: bool = False,
    ) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.encoder_budget = encoder_budget
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.encoder_cache = EncoderCacheManager(encoder_cache_size)
        self.requests: dict[str, Request] = {}
        self.waiting = RequestQueue(priority_policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # to tell the runner next step
        self._runner_has: set[str] = set()  # requests whose state the runner holds
        self.num_preemptions = 0
        self._error_outputs: list[EngineCoreOutput] = []  # failures found while scheduling
        # After a failed step: request id → computed tokens it must reach running alone.
        self.isolated: dict[str, int] = {}
        self.num_encoder_runs = 0

    # ------------------------------------------------------------------ admission

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError if it could never be scheduled."""
        self.check_schedulable(request)
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def check_schedulable(self, request: Request) -> None:
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens, but the model's context length is "
                f"{self.max_model_len} (room is needed for at least one generated token)"
            )
        for f in request.mm_features:
            limit = min(self.encoder_budget, self.encoder_cache.cache_size)
            if f.length > limit:
                raise ValueError(
                    f"an image needs {f.length} tokens, more than the encoder budget/cache allows per "
                    f"image ({limit}); raise them or send a smaller image"
                )
        if -(-(request.num_prompt_tokens + 1) // self.block_size) > self.kv.pool.num_blocks:
            raise ValueError(
                f"the prompt needs more KV blocks than the cache holds ({self.kv.pool.num_blocks})"
            )

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                outputs.append(EngineCoreOutput(request_id, [], finish_reason="abort"))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        token_budget = self.config.max_num_batched_tokens
        encoder_budget = self.encoder_budget
        num_scheduled: dict[str, int] = {}
        encoder_inputs: dict[str, list[int]] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted = False
        alone = self._next_isolated()  # when set, the only request this step may schedule

        # Running requests first, oldest (or most urgent) first; preemption takes from the back.
        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            if alone is not None and request is not alone:
                i += 1
                continue
            num_new = self._num_new_tokens(request, request.num_computed_tokens, token_budget)
            plan = self._plan_encoder(request, request.num_computed_tokens, num_new, encoder_budget)
            if plan.num_new_tokens == 0:
                i += 1
                continue
            new_block_ids = self.kv.allocate_slots(request, plan.num_new_tokens)
            if new_block_ids is None and len(self.running) == 1:
                # Alone and still out of blocks: recomputing would need the same blocks again.
                self._fail_out_of_blocks(request)
                continue
            while new_block_ids is None:
                # Only requests not yet scheduled this step may be preempted: `request` or later ones.
                victim = self._pick_victim(self.running[i:])
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_block_ids = self.kv.allocate_slots(request, plan.num_new_tokens)
            if new_block_ids is None:  # `request` itself was preempted
                continue
            self._apply_encoder_plan(request, plan, encoder_inputs)
            encoder_budget = plan.encoder_budget
            num_scheduled[request.request_id] = plan.num_new_tokens
            token_budget -= plan.num_new_tokens
            if request.request_id in self._runner_has:
                cached.req_ids.append(request.request_id)
                cached.new_block_ids.append(new_block_ids)
                cached.num_computed_tokens.append(request.num_computed_tokens)
            else:
                new_reqs.append(self._new_request_data(request))
            i += 1

        # Then waiting requests, unless this step had to preempt (there is no room to grow).
        max_seqs = self.config.max_num_seqs
        if alone is not None and alone.status == RequestStatus.RUNNING:
            max_seqs = 0  # it was served above
        while self.waiting and token_budget > 0 and not preempted and len(self.running) < max_seqs:
            request = self.waiting.peek() if alone is None else alone
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = self._num_new_tokens(request, num_hit, token_budget)
            plan = self._plan_encoder(request, num_hit, num_new, encoder_budget)
            if plan.num_new_tokens == 0:
                break
            new_block_ids = self.kv.allocate_slots(request, plan.num_new_tokens, hit_blocks)
            if new_block_ids is None and alone is not None:
                if self.running:  # the others wait while it runs alone
                    self._preempt(self._pick_victim(self.running))
                    continue
                self._fail_out_of_blocks(request)
                break
            if new_block_ids is None:
                break
            if alone is None:
                self.waiting.pop()
            else:
                self.waiting.remove(request)
            self.kv.record_prefix_lookup(request.num_tokens, num_hit)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if self.waiting.priority_policy:
                # Most urgent first: served first, and victims (taken from the back) are the least urgent.
                bisect.insort(self.running, request, key=_urgency)
            else:
                self.running.append(request)
            self._apply_encoder_plan(request, plan, encoder_inputs)
            encoder_budget = plan.encoder_budget
            num_scheduled[request.request_id] = plan.num_new_tokens
            token_budget -= plan.num_new_tokens
            new_reqs.append(self._new_request_data(request))
            if alone is not None:
                break
        if alone is not None and not num_scheduled:
            # What it needs (encoder cache room, blocks) is held by requests that cannot run now.
            for victim in [r for r in reversed(self.running) if r is not alone]:
                self._preempt(victim)

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_encoder_inputs=encoder_inputs,
            finished_req_ids=self.finished_req_ids,
            free_encoder_mm_hashes=self.encoder_cache.take_freed(),
        )
        self.finished_req_ids = set()
        for request_id, n in num_scheduled.items():
            self.requests[request_id].num_computed_tokens += n
        self._runner_has.update(num_scheduled)
        return output

    def _next_isolated(self) -> Request | None:
        """The request to run alone this step, if a failed step left any (oldest first)."""
        for request_id in self.isolated:
            return self.requests[request_id]
        return None

    def _num_new_tokens(self, request: Request, num_computed: int, token_budget: int) -> int:
        num_new = request.num_tokens - num_computed
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_new = min(num_new, threshold)
        return min(num_new, token_budget)

    def _plan_encoder(self, request: Request, num_computed: int, num_new: int, budget: int) -> _EncoderPlan:
        """Cached images the span reads are kept: their room cannot go to the ones it encodes."""
        cache = self.encoder_cache
        to_encode, to_reference = [], []
        encoded: set[str] = set()
        kept: set[str] = set()
        encode_size = 0
        for index, f in enumerate(request.mm_features):
            if f.offset >= num_computed + num_new:
                break
            if f.offset + f.length <= num_computed or f.mm_hash in encoded or f.mm_hash in kept:
                continue  # already computed past this image, or already in the plan
            is_cached = cache.is_cached(f.mm_hash)
            if is_cached:
                fits = cache.can_allocate(encode_size, keep=kept | {f.mm_hash})
            else:
                fits = f.length <= budget and cache.can_allocate(encode_size + f.length, keep=kept)
            if not fits:
                num_new = max(f.offset - num_computed, 0)  # stop just before this image
                break
            if is_cached:
                kept.add(f.mm_hash)
                to_reference.append(index)
            else:
                budget -= f.length
                encode_size += f.length
                encoded.add(f.mm_hash)
                to_encode.append(index)
        return _EncoderPlan(num_new, to_encode, to_reference, budget)

    def _apply_encoder_plan(self, request: Request, plan: _EncoderPlan, encoder_inputs: dict) -> None:
        rid = request.request_id
        for index in plan.to_reference:  # first, so that allocating cannot evict them
            self.encoder_cache.add_reference(request.mm_features[index].mm_hash, rid)
        for index in plan.to_encode:
            f = request.mm_features[index]
            self.encoder_cache.allocate(f.mm_hash, f.length, rid)
        if plan.to_encode:
            encoder_inputs[rid] = plan.to_encode
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

    def _pick_victim(self, candidates: list[Request]) -> Request:
        if self.waiting.priority_policy:
            return max(candidates, key=_urgency)
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release_resources(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)

    # ------------------------------------------------------------------ after the model ran

    def update_from_output(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        outputs = self.take_error_outputs()
        logprobs = runner_output.logprobs
        for request_id, new_tokens in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            if self.isolated.get(request_id, -1) <= request.num_computed_tokens:
                self.isolated.pop(request_id, None)  # past where the failed step reached: cleared
            self._release_passed_images(request)
            if not new_tokens:
                continue  # mid-prefill
            accepted = []
            for token in new_tokens:
                request.append_output_token(token)
                accepted.append(token)
                status = self._check_stop(request, token)
                if status is not None:
                    self._finish(request, status)
                    break
            lp = logprobs.get(request_id)
            outputs.append(
                EngineCoreOutput(
                    request_id,
                    accepted,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    new_logprobs=Logprobs(lp.token_ids, lp.logprobs, lp.sampled_ranks) if lp else None,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                )
            )
        return EngineCoreOutputs(outputs=outputs, stats=self.stats())

    def take_error_outputs(self) -> list[EngineCoreOutput]:
        outputs, self._error_outputs = self._error_outputs, []
        return outputs

    def recover_failed_step(self, so: SchedulerOutput, message: str) -> None:
        """Undo a step whose model run raised, after `schedule` returned `so`.

        Nothing the step computed is trusted: blocks it filled lose their prefix-cache hashes and
        images it encoded leave the encoder cache; what it should have told the runner
        (finished requests, freed images) is told again with the next step. A request alone in
        the step caused the failure and fails with `message`; several are all preempted and
        isolated, then each runs alone up to where this step reached, where the culprit fails
        by itself.
        """
        self.finished_req_ids |= so.finished_req_ids
        self.encoder_cache.freed.extend(so.free_encoder_mm_hashes)
        encoded = {
            self.requests[rid].mm_features[index].mm_hash
            for rid, indices in so.scheduled_encoder_inputs.items()
            if rid in self.requests
            for index in indices
        }
        step = [self.requests[rid] for rid in so.num_scheduled_tokens if rid in self.requests]
        for request in step:
            before = request.num_computed_tokens - so.num_scheduled_tokens[request.request_id]
            self.kv.uncache_from(request, before // self.block_size)
        if len(step) == 1:
            self._fail(step[0], message)
        else:
            for request in step:  # isolated oldest first
                self.isolated.setdefault(request.request_id, request.num_computed_tokens)
            for request in reversed(step):  # pushed to the front: keep their order
                self._preempt(request)
        for mm_hash in encoded:
            self.encoder_cache.discard(mm_hash)

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens and token in params.all_stop_token_ids:
            if token in params.stop_token_ids:
                request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _release_passed_images(self, request: Request) -> None:
        """Keep references only to images the request is in the middle of. An image repeated later
        in the prompt is referenced again when reached (a hit while it stays cached): holding it
        across the gap could fill the cache with images that requests wait on each other to pass."""
        num_computed = request.num_computed_tokens
        inside = {f.mm_hash for f in request.mm_features if f.offset < num_computed < f.offset + f.length}
        for f in request.mm_features:
            if f.offset < num_computed and f.mm_hash not in inside:
                self.encoder_cache.release(f.mm_hash, request.request_id)

    def _fail(self, request: Request, message: str) -> None:
        self._finish(request, RequestStatus.FINISHED_ERROR)
        self._error_outputs.append(
            EngineCoreOutput(request.request_id, [], finish_reason="error", error=message)
        )

    def _fail_out_of_blocks(self, request: Request) -> None:
        self._fail(request, f"the KV cache ({self.kv.pool.num_blocks} blocks) cannot hold this request")

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.isolated.pop(request.request_id, None)
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._release_resources(request)
        del self.requests[request.request_id]

    def _release_resources(self, request: Request) -> None:
        self.kv.free(request)
        self.encoder_cache.release_all(request.request_id, [f.mm_hash for f in request.mm_features])
        if request.request_id in self._runner_has:
            self._runner_has.discard(request.request_id)
            self.finished_req_ids.add(request.request_id)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            kv_blocks_in_use=self.kv.num_used_blocks,
            prefix_cache_queries=self.kv.prefix_stats.queries,
            prefix_cache_hits=self.kv.prefix_stats.hits,
            encoder_runs=self.num_encoder_runs,
            encoder_cache_hits=self.encoder_cache.num_hits,
            encoder_cache_references=self.encoder_cache.num_references(),
            num_preemptions=self.num_preemptions,
        )
