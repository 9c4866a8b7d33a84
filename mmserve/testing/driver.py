"""A fixed-chunk stand-in for the scheduler, to drive a ModelRunner directly in model tests.

Every step each unfinished request gets `chunk_size` tokens of its prompt (or one token once
decoding); blocks come from a simple counter. It exercises exactly the runner paths the real
scheduler uses — new requests, diffs, chunk boundaries inside images, encoder inputs — with none
of the scheduler's policy, so a model bug cannot hide behind a scheduling one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import xxhash

from mmserve.core.sched_output import (
    CachedRequestData,
    LogprobsLists,
    MultiModalFeature,
    NewRequestData,
    SchedulerOutput,
)
from mmserve.sampling_params import SamplingParams
from mmserve.testing.reference import PromptInputs
from mmserve.worker.model_runner import ModelRunner


@dataclass
class _Req:
    req_id: str
    prompt: PromptInputs
    features: list[MultiModalFeature]
    pixels: dict[str, np.ndarray]  # mm_hash → pixels, sent with the step that encodes the item
    params: SamplingParams
    max_new_tokens: int
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    logprobs: list[LogprobsLists] = field(default_factory=list)
    encoded: set[int] = field(default_factory=set)
    sent: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt.token_ids) + len(self.output)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class ChunkedDriver:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.next_block = 0
        self.chunk_size = 0

    def generate(
        self,
        prompts: list[PromptInputs],
        max_new_tokens: int,
        chunk_size: int,
        params: SamplingParams | None = None,
    ) -> list[_Req]:
        self.chunk_size = chunk_size
        params = params or SamplingParams(temperature=0.0, max_tokens=max_new_tokens, logprobs=5)
        reqs = [_Req(f"r{i}", p, *_features(p), params, max_new_tokens) for i, p in enumerate(prompts)]
        while not all(r.done for r in reqs):
            self._step([r for r in reqs if not r.done])
        self.runner.execute_model(_finish_output(reqs))
        return reqs

    def _step(self, active: list[_Req]) -> None:
        new, cached = [], CachedRequestData()
        num_scheduled, encoder_inputs, encoder_pixels = {}, {}, {}
        for r in active:
            n = min(self._chunk(r), r.num_tokens - r.num_computed)
            end = r.num_computed + n
            new_blocks = self._allocate(r, end)
            due = [
                i
                for i, f in enumerate(r.features)
                if i not in r.encoded and f.offset < end and f.offset + f.length > r.num_computed
            ]
            if due:
                encoder_inputs[r.req_id] = due
                encoder_pixels.update({r.features[i].mm_hash: r.pixels[r.features[i].mm_hash] for i in due})
                r.encoded.update(due)
            num_scheduled[r.req_id] = n
            if not r.sent:
                new.append(
                    NewRequestData(
                        r.req_id, r.prompt.token_ids, r.features, r.params, list(r.blocks), r.num_computed
                    )
                )
                r.sent = True
            else:
                cached.req_ids.append(r.req_id)
                cached.new_block_ids.append(new_blocks)
                cached.num_computed_tokens.append(r.num_computed)
        out = self.runner.execute_model(
            SchedulerOutput(
                new,
                cached,
                num_scheduled,
                sum(num_scheduled.values()),
                encoder_inputs,
                set(),
                [],
                encoder_pixels=encoder_pixels,
            )
        )
        for req_id, tokens in zip(out.req_ids, out.sampled_token_ids):
            r = next(x for x in active if x.req_id == req_id)
            r.num_computed += num_scheduled[req_id]
            r.output.extend(tokens)
            if req_id in out.logprobs:
                r.logprobs.append(out.logprobs[req_id])

    def _chunk(self, r: _Req) -> int:
        return self.chunk_size if r.num_computed < len(r.prompt.token_ids) else 1

    def _allocate(self, r: _Req, num_tokens: int) -> list[int]:
        needed = -(-num_tokens // self.block_size) - len(r.blocks)
        fresh = list(range(self.next_block, self.next_block + max(needed, 0)))
        self.next_block += len(fresh)
        r.blocks.extend(fresh)
        return fresh


def _features(prompt: PromptInputs) -> tuple[list[MultiModalFeature], dict[str, np.ndarray]]:
    """The prompt's image features, and their pixels by mm_hash."""
    hashes = [xxhash.xxh3_128_hexdigest(pixels.tobytes()) for pixels in prompt.pixel_values]
    features = [
        MultiModalFeature(mm_hash, offset, length, grid)
        for mm_hash, (offset, length), grid in zip(hashes, prompt.image_spans, prompt.grid_thw)
    ]
    return features, dict(zip(hashes, prompt.pixel_values))


def _finish_output(reqs: list[_Req]) -> SchedulerOutput:
    """Tell the runner every request finished and every image may leave its encoder cache."""
    out = SchedulerOutput.empty()
    out.dropped_req_ids = {r.req_id for r in reqs}
    out.free_encoder_mm_hashes = [f.mm_hash for r in reqs for f in r.features]
    return out
