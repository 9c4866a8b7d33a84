"""The scheduler, driven step by step against a fake model runner (no torch, no model).

`FakeRunner` keeps per-request state only from the SchedulerOutput diffs, as the real runner
does, "encodes" images into its own encoder cache, writes one KV entry per computed token into
the paged slots and samples from what attention would read: a deterministic function of the
whole context. A wrong block table, a bad prefix hit or missing image embeddings therefore
change the sampled tokens (and trip an assertion first). `expected_output` computes the same
tokens without any scheduler, so every scheduled run is checked against it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import xxhash
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.core.engine_core import EngineCore
from mmserve.core.request import Request
from mmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from mmserve.core.scheduler import Scheduler
from mmserve.protocol import EngineCoreOutput, EngineRequest, MultiModalFeature
from mmserve.sampling_params import SamplingParams

IMAGE_TOKEN = 100
EOS = 1
VOCAB = 64  # sampled ids are 0..63; EOS is one of them

Entry = tuple  # (token_id, (mm_hash, index in image) | None): what one KV slot holds
Sampler = Callable[[tuple[Entry, ...]], int]


def content_sampler(context: tuple[Entry, ...]) -> int:
    """The fake model: the next token is a hash of every KV entry it attends to."""
    return xxhash.xxh64_intdigest(repr(context).encode()) % VOCAB


# ---------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Image:
    mm_hash: str
    length: int  # placeholder tokens = embeddings


def build_prompt(*parts: list[int] | Image) -> tuple[list[int], list[MultiModalFeature]]:
    """Text runs and images in order → token ids (placeholders expanded) and features."""
    tokens: list[int] = []
    features: list[MultiModalFeature] = []
    for part in parts:
        if isinstance(part, Image):
            features.append(MultiModalFeature(part.mm_hash, len(tokens), part.length, (1, 1, part.length)))
            tokens += [IMAGE_TOKEN] * part.length
        else:
            tokens += list(part)
    return tokens, features


def text(n: int, start: int = 2) -> list[int]:
    return [start + i % 50 for i in range(n)]


def entry(tokens: list[int], features: list[MultiModalFeature], p: int) -> Entry:
    for f in features:
        if f.offset <= p < f.offset + f.length:
            return (tokens[p], (f.mm_hash, p - f.offset))
    return (tokens[p], None)


def expected_output(
    prompt: list[int],
    features: list[MultiModalFeature],
    params: SamplingParams,
    max_model_len: int,
    sampler: Sampler = content_sampler,
) -> tuple[list[int], str]:
    """What an unconstrained engine returns: sampled tokens and the finish reason."""
    tokens = list(prompt)
    context = [entry(tokens, features, p) for p in range(len(tokens))]
    out: list[int] = []
    while True:
        token = sampler(tuple(context))
        context.append((token, None))
        tokens.append(token)
        out.append(token)
        if len(out) >= params.min_tokens and token in params.all_stop_token_ids:
            return out, "stop"
        if params.max_tokens is not None and len(out) >= params.max_tokens:
            return out, "length"
        if len(tokens) >= max_model_len:
            return out, "length"


# ---------------------------------------------------------------------------- the fake runner


@dataclass
class RunnerRequest:
    tokens: list[int]
    features: list[MultiModalFeature]
    block_ids: list[int]
    num_computed: int


class FakeRunner:
    def __init__(self, block_size: int, sampler: Sampler = content_sampler) -> None:
        self.block_size = block_size
        self.sampler = sampler
        self.kv: dict[int, Entry] = {}  # slot → what was written there
        self.states: dict[str, RunnerRequest] = {}
        self.encoder_cache: set[str] = set()
        self.encodes: list[tuple[int, str, str]] = []  # (step, request id, mm_hash)
        self.num_steps = 0

    def _slot(self, state: RunnerRequest, p: int) -> int:
        return state.block_ids[p // self.block_size] * self.block_size + p % self.block_size

    def execute_model(self, so: SchedulerOutput, fail: bool = False) -> ModelRunnerOutput:
        """`fail`: the step raises after updating states, encoding and writing garbage KV for
        the scheduled tokens, as a model run that breaks half-way would leave things."""
        step = self.num_steps
        self.num_steps += 1
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
        self.encoder_cache.difference_update(so.free_encoder_mm_hashes)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            assert req_id in self.states, f"diff for {req_id}, which the runner does not hold"
            self.states[req_id].block_ids += new_blocks
            self.states[req_id].num_computed = num_computed
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent in full twice"
            self.states[new.req_id] = RunnerRequest(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                list(new.mm_features),
                list(new.block_ids),
                new.num_computed_tokens,
            )
        assert set(so.num_scheduled_tokens) <= set(self.states)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty()

        for req_id, indices in so.scheduled_encoder_inputs.items():
            state = self.states[req_id]
            start, end = state.num_computed, state.num_computed + so.num_scheduled_tokens[req_id]
            for index in indices:
                f = state.features[index]
                assert f.offset < end and start < f.offset + f.length, "encoded outside the step's span"
                assert f.mm_hash not in self.encoder_cache, f"{f.mm_hash} encoded again while cached"
                self.encoder_cache.add(f.mm_hash)
                self.encodes.append((step, req_id, f.mm_hash))

        if fail:
            for req_id, n in so.num_scheduled_tokens.items():
                state = self.states[req_id]
                for p in range(state.num_computed, state.num_computed + n):
                    self.kv[self._slot(state, p)] = ("garbage", None)
            raise RuntimeError("the model run failed")

        # Every layer writes the step's keys/values first, then attends (as the real backend does).
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.states[req_id]
            end = state.num_computed + n
            assert end <= len(state.tokens), f"{req_id}: scheduled past its known tokens"
            assert len(state.block_ids) * self.block_size >= end, f"{req_id}: too few blocks"
            for p in range(state.num_computed, end):
                e = entry(state.tokens, state.features, p)
                if e[1] is not None:
                    assert e[1][0] in self.encoder_cache, f"{req_id}: embeddings of {e[1][0]} missing"
                self.kv[self._slot(state, p)] = e

        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.states[req_id]
            end = state.num_computed + n
            context = tuple(self.kv.get(self._slot(state, p)) for p in range(end))
            want = tuple(entry(state.tokens, state.features, p) for p in range(end))
            assert context == want, f"{req_id}: attention would read wrong KV"
            state.num_computed = end
            new_tokens = []
            if end >= len(state.tokens):
                token = self.sampler(context)
                state.tokens.append(token)
                new_tokens = [token]
            req_ids.append(req_id)
            sampled.append(new_tokens)
        return ModelRunnerOutput(req_ids, sampled)


# ---------------------------------------------------------------------------- the harness


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
        priority_policy: bool = False,
        enable_prefix_caching: bool = True,
        sampler: Sampler = content_sampler,
    ) -> None:
        self.config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=long_prefill_token_threshold,
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
            priority_policy=priority_policy,
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
        isolating = bool(self.scheduler.isolated)
        so = self.scheduler.schedule()
        for new in so.scheduled_new_reqs:
            self.admission[new.req_id] = self.num_admissions
            self.num_admissions += 1
        preempted = [r for r in was_running if r not in self.scheduler.running and not r.is_finished]
        self.check_decision(so)
        if isolating:  # one request runs alone; the others may have to make room for it
            assert len(so.num_scheduled_tokens) <= 1
        else:
            self.check_victims(preempted)
        fail = bool(self.poison & set(so.num_scheduled_tokens))
        try:
            runner_output = self.runner.execute_model(so, fail=fail)
        except RuntimeError:
            self.scheduler.recover_failed_step(so, "internal error")
            self._record(self.scheduler.take_error_outputs())
        else:
            self._record(self.scheduler.update_from_output(so, runner_output).outputs)
        self.decisions.append(dict(so.num_scheduled_tokens))
        self.check_state()
        return so

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

    def check_decision(self, so: SchedulerOutput) -> None:
        n = so.num_scheduled_tokens
        assert all(v > 0 for v in n.values()), n
        assert so.total_num_scheduled_tokens == sum(n.values())
        assert so.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len(n) <= self.config.max_num_seqs
        if self.config.long_prefill_token_threshold:
            assert max(n.values(), default=0) <= self.config.long_prefill_token_threshold
        encoded = [
            self.scheduler.requests[rid].mm_features[i].length
            for rid, indices in so.scheduled_encoder_inputs.items()
            for i in indices
        ]
        assert sum(encoded) <= self.encoder_budget
        assert len(self.scheduler.running) <= self.config.max_num_seqs

    def check_victims(self, preempted: list[Request]) -> None:
        """A preempted request is the least urgent (priority policy) or the most recently admitted
        (FCFS) of all the requests it leaves running."""
        for victim in preempted:
            for request in self.scheduler.running:
                if self.scheduler.waiting.priority_policy:
                    assert (victim.priority, victim.arrival_time) >= (request.priority, request.arrival_time)
                else:
                    assert self.admission[victim.request_id] > self.admission[request.request_id]

    def check_state(self) -> None:
        sched = self.scheduler
        assert_pool_consistent(sched.kv.pool)
        holders: dict[int, int] = {}
        for rid, blocks in sched.kv.req_to_blocks.items():
            assert rid in sched.requests
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

        enc = sched.encoder_cache
        assert enc.num_free_slots + sum(enc.sizes.values()) == enc.cache_size
        assert enc.num_free_slots >= 0
        assert set(enc.refs) == set(enc.sizes)
        assert set(enc.unreferenced) == {h for h, refs in enc.refs.items() if not refs}
        # A request references exactly the images it is in the middle of.
        held = {(rid, mm_hash) for mm_hash, refs in enc.refs.items() for rid in refs}
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
        assert sched.encoder_cache.num_references() == 0
        so = sched.schedule()
        assert so.total_num_scheduled_tokens == 0
        self.runner.execute_model(so)
        assert self.runner.states == {}


def assert_pool_consistent(pool) -> None:
    queue = pool.free_queue
    forward = list(queue)
    backward, block = [], queue._tail.prev_free
    while block is not queue._head:
        backward.append(block)
        block = block.prev_free
    assert backward[::-1] == forward
    assert len(forward) == queue.num_free == len({b.block_id for b in forward})
    in_free = {b.block_id for b in forward}
    for b in pool.blocks:
        assert b.ref_cnt >= 0
        assert (b.ref_cnt == 0) == (b.block_id in in_free), b
        if b.block_hash is not None:
            assert pool.cached[b.block_hash] is b
    for block_hash, b in pool.cached.items():
        assert b.block_hash == block_hash


def engine_request(request_id, prompt, features, params) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        mm_features=features,
        sampling_params=params,
        arrival_time=0.0,
    )


# ============================================================================ the step decision


def test_each_step_respects_the_token_budget_and_max_num_seqs():
    h = Harness(max_num_batched_tokens=10, max_num_seqs=2)
    for i in range(5):
        h.add(f"r{i}", text(7 + i), max_tokens=5)
    h.run()
    assert max(sum(d.values()) for d in h.decisions) == 10
    assert max(len(d) for d in h.decisions) == 2
    for rid in h.results:
        assert (h.results[rid].tokens, h.results[rid].finish_reason) == h.expected(rid)
    h.check_all_freed()


def test_prompt_and_decode_tokens_share_one_budget():
    h = Harness(max_num_batched_tokens=10)
    h.add("a", text(6), max_tokens=8)
    h.step()  # a: its whole prompt
    h.add("b", text(30))
    assert h.step().num_scheduled_tokens == {"a": 1, "b": 9}
    assert h.step().num_scheduled_tokens == {"a": 1, "b": 9}


def test_running_requests_are_scheduled_before_waiting_ones():
    h = Harness(max_num_batched_tokens=8)
    h.add("a", text(20))
    h.step()
    h.add("b", text(4))
    assert h.step().num_scheduled_tokens == {"a": 8}
    assert h.step().num_scheduled_tokens == {"a": 4, "b": 4}


def test_waiting_requests_are_served_first_come_first_served():
    h = Harness(max_num_seqs=1)
    for rid in ("c", "a", "b"):
        h.add(rid, text(5), max_tokens=2)
    h.run()
    assert h.finish_order == ["c", "a", "b"]


def test_long_prefill_token_threshold_caps_one_requests_share():
    h = Harness(max_num_batched_tokens=32, long_prefill_token_threshold=6)
    h.add("long", text(20))
    h.add("other", text(20, start=9))
    assert h.step().num_scheduled_tokens == {"long": 6, "other": 6}
    h.run()
    for rid in h.results:
        assert (h.results[rid].tokens, h.results[rid].finish_reason) == h.expected(rid)


# ============================================================================ images


def test_chunked_prefill_splits_an_image_and_encodes_it_once_in_its_first_step():
    h = Harness(max_num_batched_tokens=8, encoder_budget=16)
    h.add("r", text(6), Image("img-a", 16), text(5))
    spans = [h.step() for _ in range(4)]
    assert [so.num_scheduled_tokens["r"] for so in spans] == [8, 8, 8, 3]
    assert spans[0].scheduled_encoder_inputs == {"r": [0]}
    assert all(not so.scheduled_encoder_inputs for so in spans[1:])
    assert h.encodes_of("img-a") == [(0, "r", "img-a")]
    h.run()
    assert (h.results["r"].tokens, h.results["r"].finish_reason) == h.expected("r")


def test_span_stops_before_an_uncached_image_when_others_used_the_encoder_budget():
    h = Harness(max_num_batched_tokens=64, encoder_budget=10, encoder_cache_size=20)
    h.add("a", text(2), Image("img-a", 8), text(2))
    h.add("b", text(3), Image("img-b", 8), text(2))
    first = h.step()
    assert first.num_scheduled_tokens == {"a": 12, "b": 3}  # b stops just before its image
    assert first.scheduled_encoder_inputs == {"a": [0]}
    second = h.step()
    assert second.num_scheduled_tokens["b"] == 10
    assert second.scheduled_encoder_inputs == {"b": [0]}
    h.run()
    for rid in h.results:
        assert (h.results[rid].tokens, h.results[rid].finish_reason) == h.expected(rid)


def test_span_stops_before_an_image_that_does_not_fit_the_encoder_cache_yet():
    h = Harness(max_num_batched_tokens=8, encoder_budget=10, encoder_cache_size=10)
    h.add("a", Image("img-a", 10), text(2))
    h.add("b", text(2), Image("img-b", 10))
    assert h.step().num_scheduled_tokens == {"a": 8}
    assert h.step().num_scheduled_tokens == {"a": 4, "b": 2}  # b stops: the cache holds img-a
    assert h.step().num_scheduled_tokens == {"a": 1, "b": 7}  # a is past img-a: evicted for img-b
    assert h.runner.encodes == [(0, "a", "img-a"), (2, "b", "img-b")]
    h.run()
    for rid in h.results:
        assert (h.results[rid].tokens, h.results[rid].finish_reason) == h.expected(rid)


@pytest.mark.parametrize(("encoder_budget", "encoder_cache_size"), [(8, 64), (64, 8)])
def test_image_larger_than_the_encoder_budget_or_cache_is_rejected_at_admission(
    encoder_budget, encoder_cache_size
):
    h = Harness(encoder_budget=encoder_budget, encoder_cache_size=encoder_cache_size)
    with pytest.raises(ValueError, match="an image needs 9 tokens"):
        h.add("r", text(2), Image("img-a", 9))
    assert not h.scheduler.has_unfinished_requests()


def test_engine_core_answers_an_unschedulable_request_with_an_error_output():
    sched = Harness(encoder_budget=8).scheduler
    core = EngineCore(sched, FakeRunner(sched.block_size))
    prompt, features = build_prompt(text(2), Image("img-a", 9))
    core.add_request(engine_request("r", prompt, features, SamplingParams()))
    outputs = core.step().outputs
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("r", "error")]
    assert "encoder budget" in outputs[0].error
    assert not core.has_work()


def test_second_request_with_a_cached_image_does_not_encode_it_again():
    h = Harness()
    h.add("a", text(3), Image("img-a", 8), text(2))
    h.run()
    h.add("b", text(5, start=30), Image("img-a", 8), text(2))
    h.run()
    assert len(h.encodes_of("img-a")) == 1
    assert h.scheduler.encoder_cache.num_hits == 1
    assert (h.results["b"].tokens, h.results["b"].finish_reason) == h.expected("b")


def test_two_requests_with_the_same_image_in_one_step_encode_it_once():
    h = Harness()
    h.add("a", text(3), Image("img-a", 8))
    h.add("b", text(4, start=20), Image("img-a", 8))
    so = h.step()
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    assert so.scheduled_encoder_inputs == {"a": [0]}
    h.run()
    assert len(h.encodes_of("img-a")) == 1
    for rid in h.results:
        assert (h.results[rid].tokens, h.results[rid].finish_reason) == h.expected(rid)


def test_the_same_image_twice_in_one_prompt_is_encoded_once():
    h = Harness(max_num_batched_tokens=6)
    h.add("r", text(2), Image("img-a", 5), text(3), Image("img-a", 5), text(2))
    h.run()
    assert len(h.encodes_of("img-a")) == 1
    assert (h.results["r"].tokens, h.results["r"].finish_reason) == h.expected("r")


def test_encoder_reference_is_released_once_the_request_computes_past_the_image():
    h = Harness(max_num_batched_tokens=8)
    h.add("r", text(2), Image("img-a", 8), text(20))
    enc = h.scheduler.encoder_cache
    h.step()  # tokens 0..8: mid-image
    assert enc.refs["img-a"] == {"r"}
    h.step()  # tokens 8..16: past the image's end (10)
    assert h.scheduler.running and enc.num_references() == 0
    assert enc.is_cached("img-a")  # still cached for a later request, just unreferenced


def test_cached_image_is_not_evicted_for_another_image_the_same_span_needs():
    # The span covers img-b (cached, unreferenced) and img-c (to encode, needing all the room but
    # img-b's): the plan must not count img-b as evictable, so the span stops before img-c.
    h = Harness(max_num_batched_tokens=64, encoder_budget=16, encoder_cache_size=16)
    h.add("a", Image("img-b", 8), text(2))
    h.run()
    assert h.scheduler.encoder_cache.unreferenced == {"img-b": None}
    h.add("b", text(2), Image("img-b", 8), text(2), Image("img-c", 10), text(2))
    h.run()
    assert len(h.encodes_of("img-b")) == 1
    assert (h.results["b"].tokens, h.results["b"].finish_reason) == h.expected("b")
    h.check_all_freed()


def test_a_repeated_image_is_encoded_again_when_the_image_between_needed_its_room():
    # The cache holds one image: img-b evicts img-a, which is encoded again at its second
    # occurrence instead of pinning the cache (and the request) forever.
    h = Harness(encoder_budget=12, encoder_cache_size=12)
    h.add("r", Image("img-a", 8), text(2), Image("img-b", 8), text(2), Image("img-a", 8), text(1))
    h.run()
    assert [e[2] for e in h.runner.encodes] == ["img-a", "img-b", "img-a"]
    assert (h.results["r"].tokens, h.results["r"].finish_reason) == h.expected("r")
    h.check_all_freed()


def test_requests_repeating_images_do_not_deadlock_the_encoder_cache():
    # Each request alone fits the cache (13), but holding img-x and img-y across their gaps
    # would leave 3 free embeddings while both wait for room for an 8-token image.
    h = Harness(
        max_num_batched_tokens=6, long_prefill_token_threshold=3, encoder_budget=13, encoder_cache_size=13
    )
    h.add("r1", Image("img-x", 5), text(2), Image("img-z", 8), text(2), Image("img-x", 5), text(1))
    h.add("r2", Image("img-y", 5), text(2, start=20), Image("img-w", 8), text(2), Image("img-y", 5), text(1))
    h.run(max_steps=100)
    for rid in h.results:
        assert (h.results[rid].tokens, h.results[rid].finish_reason) == h.expected(rid)
    h.check_all_freed()


# ============================================================================ freeing


def test_finishing_frees_every_block_and_encoder_reference():
    h = Harness()
    h.add("a", text(5), Image("img-a", 8), text(3), max_tokens=6)
    h.add("b", text(9), max_tokens=3)
    h.run()
    assert {r.finish_reason for r in h.results.values()} <= {"length", "stop"}
    h.check_all_freed()


def test_aborting_a_waiting_request_frees_it():
    h = Harness(max_num_seqs=1)
    h.add("a", text(5), max_tokens=10)
    h.add("b", text(5), Image("img-b", 4))
    h.step()
    h.abort("b")
    assert h.results["b"].finish_reason == "abort"
    h.run()
    h.check_all_freed()


def test_aborting_a_running_request_mid_image_frees_its_blocks_and_encoder_reference():
    h = Harness(max_num_batched_tokens=6)
    h.add("a", text(2), Image("img-a", 12), text(3))
    h.step()
    assert h.scheduler.encoder_cache.num_references() == 1
    h.abort("a")
    assert (h.results["a"].tokens, h.results["a"].finish_reason) == ([], "abort")
    assert h.scheduler.kv.num_used_blocks == 0
    assert h.scheduler.encoder_cache.num_references() == 0
    assert h.scheduler.schedule().finished_req_ids == {"a"}  # the runner drops its state
    assert h.scheduler.abort_requests(["a", "unknown"]) == []


def test_aborting_a_preempted_request_frees_it():
    h = Harness(num_blocks=6, max_num_batched_tokens=64)
    h.add("a", text(7), max_tokens=12)
    h.add("b", text(7, start=20), max_tokens=12)
    h.run_until(lambda: h.scheduler.num_preemptions > 0)
    (preempted,) = list(h.scheduler.waiting)
    h.abort(preempted.request_id)
    h.run()
    h.check_all_freed()


# ============================================================================ preemption


def test_preempted_request_completes_with_the_tokens_it_would_have_produced():
    h = Harness(num_blocks=10, max_num_batched_tokens=16)
    for i in range(4):
        h.add(f"r{i}", text(6, start=3 * i), Image(f"img-{i}", 4), text(2), max_tokens=14)
    h.run()
    assert h.scheduler.num_preemptions > 0
    for rid in h.results:
        assert (h.results[rid].tokens, h.results[rid].finish_reason) == h.expected(rid)
    h.check_all_freed()


def test_preemption_takes_the_most_recently_admitted_request_under_fcfs():
    h = Harness(num_blocks=4, max_num_batched_tokens=64)
    h.add("a", text(4), max_tokens=8)
    h.add("b", text(4, start=20), max_tokens=8)
    h.run_until(lambda: h.scheduler.num_preemptions > 0)
    assert [r.request_id for r in h.scheduler.running] == ["a"]
    h.run()
    assert h.finish_order == ["a", "b"]


def test_priority_policy_admits_the_most_urgent_request_first():
    h = Harness(max_num_seqs=1, priority_policy=True)
    h.add("low", text(5), priority=5, max_tokens=2)
    h.add("high", text(5), priority=0, max_tokens=2)
    h.add("mid", text(5), priority=2, max_tokens=2)
    h.run()
    assert h.finish_order == ["high", "mid", "low"]


def test_priority_policy_preempts_the_least_urgent_running_request():
    h = Harness(num_blocks=6, max_num_batched_tokens=64, priority_policy=True)
    h.add("low", text(2), priority=5, max_tokens=12)
    h.step()
    h.add("high", text(5, start=20), priority=0, max_tokens=12)  # runs out of blocks first
    h.run_until(lambda: h.scheduler.num_preemptions > 0)
    assert [r.request_id for r in h.scheduler.running] == ["high"]
    h.run()
    assert h.finish_order == ["high", "low"]
    for rid in h.results:
        assert (h.results[rid].tokens, h.results[rid].finish_reason) == h.expected(rid)


def test_request_that_alone_can_never_fit_the_kv_cache_ends_with_an_error():
    h = Harness(num_blocks=4, max_num_batched_tokens=64)
    h.add("r", text(10), max_tokens=20)
    h.run(max_steps=50)
    assert h.results["r"].finish_reason == "error"
    assert "KV cache" in h.results["r"].error
    assert h.results["r"].tokens == h.expected("r")[0][: len(h.results["r"].tokens)]
    h.check_all_freed()


def test_preempted_request_that_can_never_fit_ends_with_an_error_instead_of_waiting_forever():
    h = Harness(num_blocks=5, max_num_batched_tokens=64)
    h.add("big", text(10), max_tokens=20)  # needs more than 5 blocks of 4 in the end
    h.add("small", text(3), max_tokens=12)
    h.run(max_steps=100)
    assert h.results["big"].finish_reason == "error"
    assert (h.results["small"].tokens, h.results["small"].finish_reason) == h.expected("small")
    h.check_all_freed()


def test_prompt_larger_than_the_kv_cache_is_rejected_at_admission():
    h = Harness(num_blocks=2)
    with pytest.raises(ValueError, match="KV blocks"):
        h.add("r", text(9))


# ============================================================================ prefix cache


def test_request_sharing_a_prefix_starts_after_the_cached_blocks():
    h = Harness()
    h.add("a", text(4), Image("img-a", 8), text(6))
    h.run()
    h.add("b", text(4), Image("img-a", 8), text(6), [7, 7])
    so = h.step()
    assert so.num_scheduled_tokens == {"b": 2 + 2}  # 16 of 20 tokens come from the cache
    h.run()
    assert h.results["b"].num_cached_tokens == 16
    assert not h.encodes_of("img-a")[1:]
    assert (h.results["b"].tokens, h.results["b"].finish_reason) == h.expected("b")


def test_same_text_with_a_different_image_recomputes_from_the_image_on():
    h = Harness()
    h.add("a", text(6), Image("img-a", 8), text(6))
    h.run()
    h.add("b", text(6), Image("img-b", 8), text(6))
    h.run()
    assert h.results["b"].num_cached_tokens == 4  # the one block before the image
    assert (h.results["b"].tokens, h.results["b"].finish_reason) == h.expected("b")


def test_prefix_hit_ending_inside_an_evicted_image_encodes_the_image_again():
    h = Harness(encoder_budget=8, encoder_cache_size=8)
    h.add("a", text(2), Image("img-a", 8), text(6))
    h.run()
    h.add("c", Image("img-c", 8), text(2))  # evicts img-a from the encoder cache
    h.run()
    h.add("b", text(2), Image("img-a", 8), text(6, start=30))
    so = h.step()
    assert h.results["b"].num_cached_tokens == 8  # two blocks: the hit ends inside the image
    assert so.scheduled_encoder_inputs == {"b": [0]}
    h.run()
    assert [e[2] for e in h.runner.encodes] == ["img-a", "img-c", "img-a"]
    assert (h.results["b"].tokens, h.results["b"].finish_reason) == h.expected("b")


def test_a_cached_prefix_computed_in_the_same_step_is_shared():
    h = Harness()
    h.add("a", text(9), max_tokens=3)
    h.add("b", [*text(8), 40], max_tokens=3)
    so = h.step()
    assert so.num_scheduled_tokens == {"a": 9, "b": 1}  # b reads a's blocks, written this step
    h.run()
    for rid in h.results:
        assert (h.results[rid].tokens, h.results[rid].finish_reason) == h.expected(rid)


# ============================================================================ engine core


def test_engine_core_steps_the_scheduler_and_reports_aborts_with_the_next_step():
    sched = Harness().scheduler
    core = EngineCore(sched, FakeRunner(sched.block_size))
    for rid in ("a", "b"):
        prompt, features = build_prompt(text(3), Image("img-a", 4))
        core.add_request(engine_request(rid, prompt, features, SamplingParams(max_tokens=3)))
    first = core.step()
    assert sorted(o.request_id for o in first.outputs) == ["a", "b"]
    assert first.stats.num_running == 2 and first.stats.encoder_runs == 1
    core.abort_requests(["b"])
    outputs = core.step().outputs
    assert outputs[0].request_id == "b" and outputs[0].finish_reason == "abort"
    while core.has_work():
        core.step()
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_in_use) == (0, 0, 0)
    assert stats.encoder_cache_references == 0 and stats.encoder_cache_hits == 1


# ============================================================================ stopping


def test_max_tokens_stops_with_length():
    h = Harness()
    h.add("r", text(5), max_tokens=3)
    h.run()
    assert (len(h.results["r"].tokens), h.results["r"].finish_reason) == (3, "length")


def scripted(outputs: list[int], prompt_len: int) -> Sampler:
    """A sampler returning outputs[i] for the i-th generated token of a prompt_len prompt."""
    return lambda context: outputs[len(context) - prompt_len]


def test_eos_stops_with_stop_and_no_stop_reason():
    h = Harness(sampler=scripted([5, 6, EOS, 7, 8], 4))
    h.add("r", text(4), max_tokens=5, eos_token_ids=[EOS])
    h.run()
    r = h.results["r"]
    assert (r.tokens, r.finish_reason, r.stop_reason) == ([5, 6, EOS], "stop", None)


def test_ignore_eos_generates_past_eos():
    h = Harness(sampler=scripted([5, EOS, 7, 8], 4))
    h.add("r", text(4), max_tokens=4, eos_token_ids=[EOS], ignore_eos=True)
    h.run()
    assert (h.results["r"].tokens, h.results["r"].finish_reason) == ([5, EOS, 7, 8], "length")


def test_stop_token_id_stops_and_is_reported_as_the_stop_reason():
    h = Harness(sampler=scripted([5, 42, 7], 4))
    h.add("r", text(4), max_tokens=3, stop_token_ids=[42])
    h.run()
    r = h.results["r"]
    assert (r.tokens, r.finish_reason, r.stop_reason) == ([5, 42], "stop", 42)


def test_min_tokens_ignores_stop_tokens_until_reached():
    h = Harness(sampler=scripted([EOS, 42, 7, EOS, 9], 4))
    h.add("r", text(4), max_tokens=5, min_tokens=3, stop_token_ids=[42], eos_token_ids=[EOS])
    h.run()
    assert (h.results["r"].tokens, h.results["r"].finish_reason) == ([EOS, 42, 7, EOS], "stop")


def test_max_model_len_caps_the_output_with_length():
    h = Harness(max_model_len=10)
    h.add("r", text(7), max_tokens=None)
    h.run()
    assert (len(h.results["r"].tokens), h.results["r"].finish_reason) == (3, "length")


def test_prompt_that_fills_the_context_is_rejected():
    h = Harness(max_model_len=10)
    with pytest.raises(ValueError, match="context length"):
        h.add("r", text(10))
    with pytest.raises(ValueError, match="empty"):
        h.add("r", [])


# ============================================================================ property test

IMAGES = {"img-a": 3, "img-b": 5, "img-c": 8, "img-d": 4}
PREFIXES = [text(5, start=10), text(9, start=20), [*text(3, start=30), IMAGE_TOKEN]]


@st.composite
def prompt_parts(draw) -> list:
    parts: list = []
    if draw(st.integers(0, 3)):
        parts.append(draw(st.sampled_from(PREFIXES)))
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.integers(0, 2)):
            name = draw(st.sampled_from(sorted(IMAGES)))
            parts.append(Image(name, IMAGES[name]))
        else:
            parts.append(draw(st.lists(st.integers(2, 9), min_size=1, max_size=6)))
    if not parts or isinstance(parts[-1], Image):
        parts.append(draw(st.lists(st.integers(2, 9), min_size=1, max_size=3)))
    return parts


@st.composite
def scenarios(draw) -> dict:
    config = dict(
        block_size=draw(st.sampled_from([2, 4])),
        num_blocks=draw(st.integers(5, 12)),
        max_num_batched_tokens=draw(st.integers(3, 24)),
        max_num_seqs=draw(st.integers(1, 5)),
        encoder_budget=draw(st.sampled_from([8, 12])),
        encoder_cache_size=draw(st.sampled_from([8, 13, 40])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 5])),
        priority_policy=draw(st.booleans()),
        enable_prefix_caching=draw(st.sampled_from([True, True, False])),
        max_model_len=draw(st.sampled_from([30, 64])),
    )
    requests = []
    for i in range(draw(st.integers(2, 8))):
        requests.append(
            dict(
                request_id=f"r{i}",
                parts=draw(prompt_parts()),
                arrival_step=draw(st.integers(0, 3)),
                abort_step=draw(st.none() | st.none() | st.integers(0, 20)),
                priority=draw(st.integers(0, 2)),
                max_tokens=draw(st.integers(1, 14)),
                min_tokens=draw(st.integers(0, 1)),
                stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
                ignore_eos=draw(st.booleans()),
                poison=draw(st.sampled_from([False] * 5 + [True])),
            )
        )
    return dict(config=config, requests=requests)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workloads_finish_with_the_expected_tokens_and_free_everything(scenario):
    h = Harness(**scenario["config"])
    block_capacity = h.scheduler.kv.pool.num_blocks * h.scheduler.block_size
    arrivals: dict[int, list[dict]] = {}
    aborts: dict[int, list[str]] = {}
    for spec in scenario["requests"]:
        arrivals.setdefault(spec["arrival_step"], []).append(spec)
        if spec["abort_step"] is not None:
            aborts.setdefault(spec["abort_step"], []).append(spec["request_id"])
    rejected = set()
    step = 0
    while step <= 6 or h.scheduler.has_unfinished_requests():
        assert step < 400, "requests still unfinished after 400 steps"
        for spec in arrivals.get(step, []):
            try:
                h.add(
                    spec["request_id"],
                    *spec["parts"],
                    priority=spec["priority"],
                    max_tokens=spec["max_tokens"],
                    min_tokens=min(spec["min_tokens"], spec["max_tokens"]),
                    stop_token_ids=spec["stop_token_ids"],
                    eos_token_ids=[EOS],
                    ignore_eos=spec["ignore_eos"],
                )
            except ValueError:
                rejected.add(spec["request_id"])
            if spec["poison"]:
                h.poison.add(spec["request_id"])
        h.abort(*[rid for rid in aborts.get(step, []) if rid in h.results])
        had_work = h.scheduler.has_unfinished_requests()
        num_preemptions, num_finished = h.scheduler.num_preemptions, len(h.finish_order)
        so = h.step()
        # Nothing outside changes the state between steps, so a step without progress repeats forever.
        assert not had_work or (
            so.total_num_scheduled_tokens
            or h.scheduler.num_preemptions > num_preemptions
            or len(h.finish_order) > num_finished
        ), "a step made no progress: the scheduler is stuck"
        step += 1

    for rid, result in h.results.items():
        want_tokens, want_reason = h.expected(rid)
        prompt, _, _ = h.prompts[rid]
        if rid in h.poison and rid not in rejected:
            # It raises whenever it runs: it fails alone, or is aborted first; nobody else fails.
            assert result.finish_reason in ("error", "abort") and result.tokens == [], (rid, result)
        elif result.finish_reason == "abort":
            assert result.tokens == want_tokens[: len(result.tokens)]
        elif result.finish_reason == "error":
            # Only a request that alone outgrows the KV cache may fail.
            assert len(prompt) + len(want_tokens) > block_capacity, result.error
            assert result.tokens == want_tokens[: len(result.tokens)]
        else:
            assert (result.tokens, result.finish_reason) == (want_tokens, want_reason), rid
    stats = h.scheduler.stats()
    event(f"preemptions: {min(stats.num_preemptions, 3)}")
    event(f"encoder cache hits: {min(stats.encoder_cache_hits, 2)}")
    event(f"prefix cache hits: {stats.prefix_cache_hits > 0}")
    event(f"rejected at admission: {len(rejected)}")
    event(f"poisoned requests: {min(len(h.poison - rejected), 2)}")
    for reason in ("abort", "error", "stop"):
        event(f"{reason}: {any(r.finish_reason == reason for r in h.results.values())}")
    h.check_all_freed()


def test_the_oracle_agrees_with_an_unconstrained_run():
    h = Harness(num_blocks=256, max_num_batched_tokens=1024, encoder_budget=64)
    h.add("a", text(3), Image("img-a", 8), text(3), max_tokens=12)
    h.add("b", text(3), Image("img-a", 8), text(9), max_tokens=12)
    h.run()
    assert h.scheduler.num_preemptions == 0
    for rid in h.results:
        assert (h.results[rid].tokens, h.results[rid].finish_reason) == h.expected(rid)


@pytest.mark.parametrize("seed", range(3))
def test_constrained_and_unconstrained_runs_return_the_same_tokens(seed):
    def workload(h: Harness) -> dict[str, tuple[list[int], str | None]]:
        for i in range(6):
            img = Image(f"img-{(i + seed) % 3}", 4 + i % 3)
            h.add(f"r{i}", PREFIXES[i % 2], img, text(2 + i, start=i), max_tokens=6 + i)
        return {rid: (r.tokens, r.finish_reason) for rid, r in h.run().items()}

    free = workload(Harness(num_blocks=512, max_num_batched_tokens=2048, encoder_budget=64))
    tight = Harness(
        num_blocks=12, max_num_batched_tokens=7, max_num_seqs=3, encoder_budget=8, encoder_cache_size=12
    )
    assert workload(tight) == free
    assert tight.scheduler.num_preemptions > 0
    tight.check_all_freed()
