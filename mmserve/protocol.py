"""Messages between the frontend (API server / offline LLM) and EngineCore.

msgspec Structs, so they cross the ZeroMQ boundary as msgpack; image pixels travel beside
them (see the serving transport), never inside the msgpack body.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from mmserve.sampling_params import SamplingParams


@dataclass
class MultiModalFeature:
    """One image of a request: where its placeholder tokens are and what to encode."""

    mm_hash: str  # content id of the image (bytes + processor settings); keys every cache
    offset: int  # index of the first placeholder token in the prompt
    length: int  # number of placeholder tokens = number of embeddings
    grid_thw: tuple[int, int, int]  # patch grid, as the processor made it
    pixel_values: np.ndarray | None = None  # [num_patches, C·T·P·P] float32, until encoded


class EngineRequest(msgspec.Struct, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0


class Logprobs(msgspec.Struct, array_like=True):
    """For each new token: [sampled, top-1..top-k] ids, their logprobs, and the sampled rank."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_ranks: list[int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id that ended the request
    new_logprobs: Logprobs | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # message for finish_reason == "error"


class SchedulerStats(msgspec.Struct, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    kv_blocks_in_use: int = 0
    prefix_cache_queries: int = 0  # cumulative, in tokens
    prefix_cache_hits: int = 0
    encoder_runs: int = 0  # cumulative images encoded
    encoder_cache_hits: int = 0  # cumulative images served from the encoder cache
    encoder_cache_references: int = 0
    num_preemptions: int = 0  # cumulative


class EngineCoreOutputs(msgspec.Struct, kw_only=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    stats: SchedulerStats | None = None
