"""The contract between the scheduler and the model runner, in both directions.

Each step the scheduler sends a `SchedulerOutput`: new requests in full (once), and for
requests the runner already holds only what changed (new blocks, how far they have been
computed). The runner answers with a `ModelRunnerOutput`: the tokens it sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mmserve.protocol import MultiModalFeature

if TYPE_CHECKING:
    import numpy as np

    from mmserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner does not hold yet (new, or resumed after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)  # non-empty when resumed


@dataclass
class CachedRequestData:
    """Diffs for requests the runner holds, in parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # appended to the block table
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class GrammarBitmask:
    """Structured outputs' allowed tokens for the requests that sample this step."""

    req_ids: list[str]
    bitmask: np.ndarray  # [len(req_ids), ceil(vocab / 32)] int32; bit j of word k = token 32k + j


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # the step's decision: request id → tokens to compute
    total_num_scheduled_tokens: int
    # request id → indices of mm_features to encode now: each mm_hash at most once per step, and
    # never one the runner still holds (frees of this step are in free_encoder_mm_hashes)
    scheduled_encoder_inputs: dict[str, list[int]]
    dropped_req_ids: set[str]  # finished, aborted or preempted — the runner drops their state
    free_encoder_mm_hashes: list[str]  # embeddings the runner may drop from its encoder cache
    grammar_bitmask: GrammarBitmask | None = None  # None: no structured request samples this step
    # mm_hash → pixels [num_patches, C·T·P·P] of each item in scheduled_encoder_inputs: pixels
    # go to the runner (to every rank) only in the step that encodes them
    encoder_pixels: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData(), {}, 0, {}, set(), [])


@dataclass
class LogprobsLists:
    """Per sampled row: token ids ([sampled, top-1, ..., top-k]), their logprobs, sampled rank."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_ranks: list[int]


@dataclass
class ModelRunnerOutput:
    """Tokens sampled this step; a request mid-prefill has an empty list."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)  # request id → its row(s)
    # request id → (first prompt position scored, logprobs of the next prompt token per position)
    prompt_logprobs: dict[str, tuple[int, LogprobsLists]] = field(default_factory=dict)
    num_encoder_runs: int = 0  # images encoded this step (a counter the engine exposes)

    @classmethod
    def empty(cls) -> ModelRunnerOutput:
        return cls([], [])


class ExecutorDeadError(RuntimeError):
    """The executor can run no more steps (a worker process died or failed mid-step): unlike a
    fault in one step, nothing is retried; the engine reports itself dead."""
