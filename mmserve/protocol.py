"""Messages between the frontend (API server / offline LLM) and EngineCore.

msgspec Structs, so they cross the ZeroMQ boundary as msgpack; pixels travel beside them as
frames of their own or stay in the preprocess pool's shared memory, named by a `PixelHandle` —
never inside the msgpack body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from mmserve.sampling_params import SamplingParams


class PixelHandle(msgspec.Struct, frozen=True, array_like=True):
    """An image's pixels in a POSIX shared-memory segment of the API server's preprocess pool.

    The pool keeps the segment (no recycling, no unlink) while `use_id` is pinned, until
    EngineCore reports `use_id` in `EngineCoreOutputs.released_pixel_handles` (or dies).
    EngineCore reads its own copy on receipt and checks it against `digest`: a segment gone,
    short or holding other pixels is reported in `EngineCoreOutputs.unreadable_pixels`, and
    the requests that need those pixels fail (never wait, never encode other pixels)."""

    shm_name: str
    shape: tuple[int, ...]  # [num_patches, C·T·P·P]
    dtype: str  # numpy dtype name, "float32"
    digest: int  # xxh3-64 of the pixel bytes in C order (preprocess.hashing.pixels_digest)
    use_id: int  # this send's pin in the pool; 0: not pinned (the prompt's, before a send)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class MultiModalFeature:
    """One image or video item of a request: where its placeholder tokens are and what it is.
    Immutable, and without pixels: those travel beside the features (`EngineRequest.mm_handles`
    and `mm_arrays`) or are in EngineCore's pixel store already, keyed by `mm_hash`.

    Every cache (pixel store, encoder cache, prefix-cache extra keys, the encoder budget) counts
    items alike whatever their modality. A model family may lay one image or video out as several
    features (a video frame by frame, with text between), each hashed `<item hash>-<index>`."""

    mm_hash: str  # hash of the item's bytes + processor settings (+ sampling); keys every cache
    offset: int  # index of the first placeholder token in the prompt
    length: int  # number of placeholder tokens = number of embeddings
    grid_thw: tuple[int, int, int]  # patch grid (temporal patches, rows, columns), as processed
    modality: str = "image"  # "image" | "video"
    # temporal position units per temporal patch, as the model family's processor computed
    # them (its positions read them: a video's may follow its frame rate)
    position_step: float = 1.0


class EngineRequest(msgspec.Struct, kw_only=True):
    """A request, and what it changes in EngineCore's pixel store (core/pixel_store.py), whose
    contents the frontend decides (frontend/pixel_store_mirror.py). EngineCore applies the
    changes on arrival, before anything else and whatever becomes of the request: first it drops
    `mm_evict`, then it adds the pixels the request brings. Every item of the request is then in
    the store: the ones it brought, and the ones it names by hash alone."""

    request_id: str
    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    mm_evict: list[str] = msgspec.field(default_factory=list)  # hashes the store drops first
    # mm_hash → pixels in the preprocess pool's shared memory, read once on arrival
    mm_handles: dict[str, PixelHandle] = msgspec.field(default_factory=dict)
    # mm_hash → pixels as arrays ([num_patches, C·T·P·P]); over ZeroMQ each is a frame of its
    # own beside the msgpack body (`encode_add`), never inside it
    mm_arrays: dict[str, Any] = msgspec.field(default_factory=dict)


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
    # Prompt logprobs of the positions computed this step, in order: position i scores prompt
    # token i + 1 (column 0 is that token, then the top k), the first position being the next
    # one not yet sent
    new_prompt_logprobs: Logprobs | None = None
    # time.monotonic() (one clock for every process of the machine) of the request's first
    # scheduling; 0 until then. The frontend derives vLLM's queue and prefill times from it.
    first_scheduled_time: float = 0.0


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


class EngineCoreOutputs(msgspec.Struct, kw_only=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    stats: SchedulerStats | None = None
    # use ids of the `PixelHandle`s received since the last outputs (read, or found unreadable):
    # EngineCore will not look at their segments again; the frontend unpins them.
    released_pixel_handles: list[int] = msgspec.field(default_factory=list)
    # mm_hashes whose handles EngineCore could not read since the last outputs (segment gone,
    # short, or holding other pixels): its store keeps them as unreadable (a request naming
    # one fails) until the frontend, told here, drops them from its mirror and so evicts them.
    unreadable_pixels: list[str] = msgspec.field(default_factory=list)


class EngineReady(msgspec.Struct, kw_only=True):
    """What EngineCore decided while starting, for the server's start-up report."""

    num_blocks: int
    device: str  # "cpu", "cuda:0"
    num_threads: int  # torch intra-op threads of the engine process
    attention_backend: str  # the resolved backend ("cpu", "torch", "triton"), never "auto"
    load_time_s: float  # from the process's start to READY: weights, kernels, KV allocation


# ---------------------------------------------------------------------------------------------
# Wire format over ZeroMQ. Frontend → EngineCore: [b"ADD", header, *pixel frames] or
# [b"ABORT", ids]. EngineCore → frontend: [b"OUT", outputs] or [b"READY"/b"FAILED", info].
# Pixel arrays travel as their own frames, sent without copying and received as views; an item
# sent by hash alone or by `PixelHandle` has no frame.

ADD, ABORT, OUT, READY, FAILED = b"ADD", b"ABORT", b"OUT", b"READY", b"FAILED"

_Layout = tuple[str, str, tuple[int, ...]]  # (mm_hash, dtype, shape) of one pixel frame
_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(tuple[EngineRequest, list[_Layout]])
_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)


def encode_add(request: EngineRequest) -> list:
    arrays = request.mm_arrays
    stripped = msgspec.structs.replace(request, mm_arrays={}) if arrays else request
    layouts = [(mm_hash, a.dtype.str, a.shape) for mm_hash, a in arrays.items()]
    frames = [np.ascontiguousarray(a).data for a in arrays.values()]
    return [ADD, _encoder.encode((stripped, layouts)), *frames]


def decode_add(frames: list) -> EngineRequest:
    request, layouts = _request_decoder.decode(frames[1])
    if len(layouts) != len(frames) - 2:
        raise ValueError(f"{len(layouts)} pixel layouts for {len(frames) - 2} pixel frames")
    request.mm_arrays = {
        mm_hash: np.frombuffer(frame, dtype=np.dtype(dtype)).reshape(shape)
        for (mm_hash, dtype, shape), frame in zip(layouts, frames[2:])
    }
    return request


def encode_abort(request_ids: list[str]) -> list:
    return [ABORT, _encoder.encode(request_ids)]


def decode_abort(frames: list) -> list[str]:
    return msgspec.msgpack.decode(frames[1], type=list[str])


def encode_ready(ready: EngineReady) -> list:
    return [READY, _encoder.encode(ready)]


def decode_ready(info: bytes) -> EngineReady:
    return msgspec.msgpack.decode(info, type=EngineReady)


def encode_outputs(outputs: EngineCoreOutputs) -> list:
    return [OUT, _encoder.encode(outputs)]


def decode_outputs(frames: list) -> EngineCoreOutputs:
    return _outputs_decoder.decode(frames[1])
