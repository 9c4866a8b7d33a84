"""A fake model runner for the scheduler's tests, and the oracle it is checked against.

`FakeRunner` keeps per-request state only from the SchedulerOutput diffs, as the real runner
does, "encodes" images into its own encoder cache, writes one KV entry per computed token into
the paged slots and samples from what attention would read: a deterministic function of the
whole context. A wrong block table, a bad prefix hit or missing image embeddings therefore
change the sampled tokens (and trip an assertion first). `expected_output` computes the same
tokens without any scheduler, so every scheduled run can be checked against it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from mmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from mmserve.protocol import MultiModalFeature
from mmserve.sampling_params import SamplingParams

VOCAB = 64  # sampled ids are 0..63
EOS = 1  # one of them: tests that want it to stop a request say so

Entry = tuple  # (token_id, (mm_hash, index in image) | None): what one KV slot holds
Sampler = Callable[[tuple[Entry, ...]], int]


def content_sampler(context: tuple[Entry, ...]) -> int:
    """The fake model: the next token is a hash of every KV entry it attends to."""
    return xxhash.xxh64_intdigest(repr(context).encode()) % VOCAB


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

    def execute_model(self, scheduler_output: SchedulerOutput, fail: bool = False) -> ModelRunnerOutput:
        """`fail`: the step raises after updating states, encoding and writing garbage KV for
        the scheduled tokens, as a model run that breaks half-way would leave things."""
        step = self.num_steps
        self.num_steps += 1
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty()
        self._encode(scheduler_output, step)
        if fail:
            for req_id, n in scheduler_output.num_scheduled_tokens.items():
                state = self.states[req_id]
                for p in range(state.num_computed, state.num_computed + n):
                    self.kv[self._slot(state, p)] = ("garbage", None)
            raise RuntimeError("the model run failed")
        # Every layer writes the step's keys/values first, then attends (as the real backend does).
        self._write_kv(scheduler_output)
        return self._sample(scheduler_output)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.dropped_req_ids:
            self.states.pop(req_id, None)
        self.encoder_cache.difference_update(scheduler_output.free_encoder_mm_hashes)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            assert req_id in self.states, f"diff for {req_id}, which the runner does not hold"
            self.states[req_id].block_ids += new_blocks
            self.states[req_id].num_computed = num_computed
        for new in scheduler_output.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent in full twice"
            self.states[new.req_id] = RunnerRequest(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                list(new.mm_features),
                list(new.block_ids),
                new.num_computed_tokens,
            )
        assert set(scheduler_output.num_scheduled_tokens) <= set(self.states)

    def _encode(self, scheduler_output: SchedulerOutput, step: int) -> None:
        for req_id, indices in scheduler_output.scheduled_encoder_inputs.items():
            state = self.states[req_id]
            start = state.num_computed
            end = start + scheduler_output.num_scheduled_tokens[req_id]
            for index in indices:
                f = state.features[index]
                assert f.offset < end and start < f.offset + f.length, "encoded outside the step's span"
                assert f.mm_hash not in self.encoder_cache, f"{f.mm_hash} encoded again while cached"
                self.encoder_cache.add(f.mm_hash)
                self.encodes.append((step, req_id, f.mm_hash))

    def _write_kv(self, scheduler_output: SchedulerOutput) -> None:
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            state = self.states[req_id]
            end = state.num_computed + n
            assert end <= len(state.tokens), f"{req_id}: scheduled past its known tokens"
            assert len(state.block_ids) * self.block_size >= end, f"{req_id}: too few blocks"
            for p in range(state.num_computed, end):
                e = entry(state.tokens, state.features, p)
                if e[1] is not None:
                    assert e[1][0] in self.encoder_cache, f"{req_id}: embeddings of {e[1][0]} missing"
                self.kv[self._slot(state, p)] = e

    def _sample(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        req_ids, sampled = [], []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
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
