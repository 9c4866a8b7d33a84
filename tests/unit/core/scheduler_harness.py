"""A Scheduler driven step by step against the FakeRunner, checking every step's decision and the
state after it: the scheduler's test bench."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from core_helpers import Image, assert_pool_consistent, build_prompt
from fake_runner import FakeRunner, Sampler, content_sampler, expected_output

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.core.request import Request
from mmserve.core.sched_output import SchedulerOutput
from mmserve.core.scheduler import Scheduler
from mmserve.protocol import EngineCoreOutput, EngineRequest, MultiModalFeature
from mmserve.sampling_params import SamplingParams


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0


class Harness:
    """A Scheduler, a FakeRunner, and checks of every step's decision and of the state after it."""

    def __init__(
        self,
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_batched_tokens: int = 32,
        max_num_seqs: int = 8,
        max_model_len: int = 512,
        encoder_budget: int = 64,
        encoder_cache_size: int | None = None,
        long_prefill_token_threshold: int = 0,
        scheduling_policy: str = "fcfs",
        enable_prefix_caching: bool = True,
        sampler: Sampler = content_sampler,
    ) -> None:
        self.config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=long_prefill_token_threshold,
            scheduling_policy=scheduling_policy,
        )
        cache = CacheConfig(
            block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching
        )
        self.encoder_budget = encoder_budget
        self.scheduler = Scheduler(
            self.config,
            cache,
            num_blocks=num_blocks,
            encoder_budget=encoder_budget,
            encoder_cache_size=encoder_cache_size or encoder_budget,
        )
        self.runner = FakeRunner(block_size, sampler)
        self.sampler = sampler
        self.results: dict[str, Result] = {}
        self.prompts: dict[str, tuple[list[int], list[MultiModalFeature], SamplingParams]] = {}
        self.decisions: list[dict[str, int]] = []
        self.finish_order: list[str] = []
        self.admission: dict[str, int] = {}  # request id → when it was (last) admitted
        self.num_admissions = 0
        self.poison: set[str] = set()  # requests whose every step raises in the runner

    # -------------------------------------------------------------- driving

    def add(
        self,
        request_id: str,
        *parts: list[int] | Image,
        priority: int = 0,
        arrival_time: float | None = None,
        **params,
    ) -> Request:
        prompt, features = build_prompt(*parts)
        params.setdefault("max_tokens", 4)
        params.setdefault("eos_token_ids", [])  # tests that want EOS say so
        sampling_params = SamplingParams(**params)
        request = Request(
            request_id,
            prompt,
            features,
            sampling_params,
            self.scheduler.block_size,
            arrival_time=len(self.prompts) if arrival_time is None else arrival_time,
            priority=priority,
        )
        self.scheduler.add_request(request)
        self.prompts[request_id] = (prompt, features, sampling_params)
        self.results[request_id] = Result()
        return request

    def abort(self, *request_ids: str) -> None:
        self._record(self.scheduler.abort_requests(request_ids))
        self.check_state()

    def step(self) -> SchedulerOutput:
        was_running = list(self.scheduler.running)
        isolating = bool(self.scheduler.step_recovery.isolated)
        scheduler_output = self.scheduler.schedule()
        for new in scheduler_output.scheduled_new_reqs:
            self.admission[new.req_id] = self.num_admissions
            self.num_admissions += 1
        preempted = [r for r in was_running if r not in self.scheduler.running and not r.is_finished]
        self.check_decision(scheduler_output)
        if isolating:  # one request runs alone; the others may have to make room for it
            assert len(scheduler_output.num_scheduled_tokens) <= 1
        else:
            self.check_victims(preempted)
        fail = bool(self.poison & set(scheduler_output.num_scheduled_tokens))
        try:
            runner_output = self.runner.execute_model(scheduler_output, fail=fail)
        except RuntimeError:
            self.scheduler.recover_failed_step(scheduler_output, "internal error")
            self._record(self.scheduler.take_error_outputs())
        else:
            self._record(self.scheduler.update_from_output(scheduler_output, runner_output).outputs)
        self.decisions.append(dict(scheduler_output.num_scheduled_tokens))
        self.check_state()
        return scheduler_output

    def run(self, max_steps: int = 500) -> dict[str, Result]:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return self.results
            self.step()
        raise AssertionError(f"still unfinished after {max_steps} steps: {self.scheduler.running}")

    def run_until(self, condition: Callable[[], bool], max_steps: int = 100) -> None:
        for _ in range(max_steps):
            if condition():
                return
            self.step()
        raise AssertionError(f"condition not reached in {max_steps} steps")

    def _record(self, outputs: list[EngineCoreOutput]) -> None:
        for o in outputs:
            result = self.results[o.request_id]
            assert result.finish_reason is None, f"{o.request_id} output after it finished"
            result.tokens += o.new_token_ids
            result.num_cached_tokens = o.num_cached_tokens
            if o.finish_reason is not None:
                result.finish_reason, result.stop_reason, result.error = (
                    o.finish_reason,
                    o.stop_reason,
                    o.error,
                )
                self.finish_order.append(o.request_id)

    def expected(self, request_id: str) -> tuple[list[int], str]:
        prompt, features, params = self.prompts[request_id]
        return expected_output(prompt, features, params, self.config.max_model_len, self.sampler)

    def encodes_of(self, mm_hash: str) -> list[tuple[int, str, str]]:
        return [e for e in self.runner.encodes if e[2] == mm_hash]

    # -------------------------------------------------------------- checks

    def check_decision(self, scheduler_output: SchedulerOutput) -> None:
        n = scheduler_output.num_scheduled_tokens
        assert all(v > 0 for v in n.values()), n
        assert scheduler_output.total_num_scheduled_tokens == sum(n.values())
        assert scheduler_output.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len(n) <= self.config.max_num_seqs
        if self.config.long_prefill_token_threshold:
            assert max(n.values(), default=0) <= self.config.long_prefill_token_threshold
        encoded = [
            self.scheduler.requests[request_id].mm_features[i].length
            for request_id, indices in scheduler_output.scheduled_encoder_inputs.items()
            for i in indices
        ]
        assert sum(encoded) <= self.encoder_budget
        assert len(self.scheduler.running) <= self.config.max_num_seqs

    def check_victims(self, preempted: list[Request]) -> None:
        """A preempted request is the least urgent (priority policy) or the most recently admitted
        (FCFS) of all the requests it leaves running."""
        for victim in preempted:
            for request in self.scheduler.running:
                if self.config.scheduling_policy == "priority":
                    assert (victim.priority, victim.arrival_time) >= (request.priority, request.arrival_time)
                else:
                    assert self.admission[victim.request_id] > self.admission[request.request_id]

    def check_state(self) -> None:
        sched = self.scheduler
        assert_pool_consistent(sched.kv.pool)
        holders: dict[int, int] = {}
        for request_id, blocks in sched.kv.req_to_blocks.items():
            assert request_id in sched.requests
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in sched.kv.pool.blocks:
            assert b.ref_cnt == holders.get(b.block_id, 0), b
        for request in sched.running:
            held = len(sched.kv.req_to_blocks[request.request_id])
            assert held == -(-request.num_computed_tokens // sched.block_size), request
        for request in sched.waiting:
            assert request.request_id not in sched.kv.req_to_blocks
            assert request.num_computed_tokens == 0

        manager = sched.encoder_cache_manager
        assert manager.num_free_slots + sum(manager.sizes.values()) == manager.cache_size
        assert manager.num_free_slots >= 0
        assert set(manager.refs) == set(manager.sizes)
        assert set(manager.unreferenced) == {h for h, refs in manager.refs.items() if not refs}
        # A request references exactly the images it is in the middle of.
        held = {(request_id, mm_hash) for mm_hash, refs in manager.refs.items() for request_id in refs}
        inside = {
            (r.request_id, f.mm_hash)
            for r in sched.running
            for f in r.mm_features
            if f.offset < r.num_computed_tokens < f.offset + f.length
        }
        assert held == inside

    def check_all_freed(self) -> None:
        """Nothing left anywhere, including in the runner once it hears of the last finishes."""
        sched = self.scheduler
        assert not sched.has_unfinished_requests()
        assert sched.requests == {}
        assert sched.kv.num_used_blocks == 0
        assert sched.kv.req_to_blocks == {}
        assert sched.encoder_cache_manager.num_references() == 0
        scheduler_output = sched.schedule()
        assert scheduler_output.total_num_scheduled_tokens == 0
        self.runner.execute_model(scheduler_output)
        assert self.runner.states == {}


def text(n: int, start: int = 2) -> list[int]:
    return [start + i % 50 for i in range(n)]


def engine_request(request_id, prompt, features, params) -> EngineRequest:
    """The request with its items' pixels (zeros of their grids' shapes)."""
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        mm_features=features,
        sampling_params=params,
        arrival_time=0.0,
        mm_arrays={f.mm_hash: np.zeros((int(np.prod(f.grid_thw)), 4), np.float32) for f in features},
    )
