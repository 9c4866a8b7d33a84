"""A request as the scheduler sees it: token ids, images, progress and status.

Prompt and generated tokens are one sequence; `num_computed_tokens` says how much of it has KV
in the cache. Block hashes are extended as tokens arrive, so prefix lookups never rehash. A
request holds its items' pixels (from the pixel store, on arrival) for its whole life, so an
item whose embeddings the encoder cache dropped can always be encoded again.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from mmserve.core.block_hash import BlockHash, extend_block_hashes
from mmserve.protocol import MultiModalFeature
from mmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        mm_features: list[MultiModalFeature],
        sampling_params: SamplingParams,
        block_size: int,
        arrival_time: float | None = None,
        priority: int = 0,
        mm_pixels: dict[str, np.ndarray] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.mm_features = sorted(mm_features, key=lambda f: f.offset)
        # mm_hash → [num_patches, C·T·P·P] for each item (the scheduler's own tests give none)
        self.mm_pixels = mm_pixels or {}
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.block_size = block_size
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.first_scheduled_time = 0.0  # time.monotonic() of its first scheduling; 0 until then
        self.num_preemptions = 0
        self.num_prompt_logprobs_sent = 0  # prompt positions whose logprobs went out
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[BlockHash] = []
        extend_block_hashes(self.block_hashes, self.all_token_ids, self.mm_features, block_size)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) % self.block_size == 0:
            extend_block_hashes(self.block_hashes, self.all_token_ids, self.mm_features, self.block_size)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, {self.status.name}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens})"
        )
